"""``Settings`` reads its ``BERTH_*`` variables itself (no pydantic-settings): the names match without
regard to case, a flag wins over the environment, a variable that names no field is ignored, and a bad
value is refused with the field's name."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from worker.config import Settings


def test_the_environment_is_read_and_a_flag_wins(monkeypatch):
    monkeypatch.setenv("BERTH_THREADS", "3")
    monkeypatch.setenv("berth_kv_memory", "2GiB")  # any case
    monkeypatch.setenv("BERTH_PREFIX_STORE", "yes")
    monkeypatch.setenv("BERTH_NO_SUCH_SETTING", "1")  # ignored, as pydantic-settings ignores it
    settings = Settings()
    assert (settings.threads, settings.kv_memory, settings.prefix_store) == (3, 2 * 2**30, True)
    assert Settings(threads=5).threads == 5


def test_a_bad_value_names_its_field(monkeypatch):
    monkeypatch.setenv("BERTH_THREADS", "many")
    with pytest.raises(ValidationError) as err:
        Settings()
    assert err.value.errors()[0]["loc"] == ("threads",)


def test_an_unknown_keyword_is_refused():
    with pytest.raises(ValidationError):
        Settings(no_such_setting=1)
