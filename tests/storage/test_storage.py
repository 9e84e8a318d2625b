"""The object-store contract, on a local folder and on S3 (moto's server): atomic put, get, exists,
list by prefix, delete, files in parts, and errors a user can act on; keys never carry user text."""

from __future__ import annotations

import os
import threading
import time

import pytest
from boto3.s3.transfer import TransferConfig

from storage import ObjectNotFound, StorageError, check_key, open_store
from storage.s3 import S3Store
from worker.checkpoint.format import RequestCheckpoint, encode_segment, kv_key, segment_key, stored_request_id


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(f"file://{tmp_path / 'store'}")
    return open_store(request.getfixturevalue("s3_url"))


def test_put_get_replace_exists_delete(store):
    assert not store.exists("a/b.json")
    store.put("a/b.json", b"one")
    store.put("a/b.json", b"two")
    assert store.get("a/b.json") == b"two" and store.exists("a/b.json")
    store.delete("a/b.json")
    store.delete("a/b.json")  # deleting what is not there is no error
    assert not store.exists("a/b.json")


def test_a_missing_key_raises_object_not_found(store):
    with pytest.raises(ObjectNotFound, match="no object 'nothing/here'"):
        store.get("nothing/here")
    with pytest.raises(ObjectNotFound):
        store.open("nothing/here")


def test_list_by_prefix_in_key_order_with_sizes_and_times(store):
    for key in ("kv/fp/02", "kv/fp/01", "kv/fpx/03", "state/1.json"):
        store.put(key, key.encode())
    t = time.time()
    listed = list(store.list("kv/fp/"))
    assert [o.key for o in listed] == ["kv/fp/01", "kv/fp/02"]
    assert [o.size for o in listed] == [8, 8]
    assert all(abs(o.modified - t) < 60 for o in listed)
    assert [o.key for o in store.list("kv/fp")] == ["kv/fp/01", "kv/fp/02", "kv/fpx/03"]
    assert len(list(store.list(""))) == 4
    assert list(store.list("nothing/")) == []


def test_readers_see_the_old_object_or_the_new_never_a_mix(store):
    size = 1 << 20
    versions = [bytes([v]) * size for v in b"ab"]
    store.put("state/x.json", versions[0])
    stop = threading.Event()
    seen, errors = set(), []

    def read():
        while not stop.is_set():
            data = store.get("state/x.json")
            if data not in versions:
                errors.append((len(data), set(data)))
            seen.add(data[:1])

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(30):
        store.put("state/x.json", versions[i % 2])
    stop.set()
    reader.join()
    assert not errors, f"torn reads: {errors[:3]}"
    assert seen <= {b"a", b"b"}


def test_streams_round_trip_and_appear_only_when_whole(store):
    with store.writer("jobs/j1/output.jsonl") as f:
        for i in range(1000):
            f.write(b"line %d\n" % i)
        assert not store.exists("jobs/j1/output.jsonl")
    with store.open("jobs/j1/output.jsonl") as f:
        assert f.read() == b"".join(b"line %d\n" % i for i in range(1000))
    with pytest.raises(RuntimeError), store.writer("jobs/j1/errors.jsonl") as f:
        f.write(b"half a file")
        raise RuntimeError("the writer fails half-way")
    assert not store.exists("jobs/j1/errors.jsonl")


def test_large_streams_go_to_s3_in_parts(s3_url):
    store = open_store(s3_url)
    store.transfer = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
    data = bytes(range(256)) * (11 << 12)  # 11 MiB: three parts
    with store.writer("jobs/j2/input.jsonl") as f:
        f.write(data)
    head = store.client.head_object(Bucket=store.bucket, Key=store.prefix + "jobs/j2/input.jsonl")
    assert head["ETag"].strip('"').endswith("-3"), "not a multipart upload"
    with store.open("jobs/j2/input.jsonl") as f:
        assert f.read() == data


def test_s3_keys_live_under_the_url_prefix(s3_url):
    store = open_store(s3_url)
    store.put("k", b"v")
    names = [o["Key"] for o in store.client.list_objects_v2(Bucket=store.bucket)["Contents"]]
    assert names == ["deployment-a/k"]


def test_s3_missing_bucket_says_what_to_do(s3_endpoint):
    with pytest.raises(StorageError, match="does not exist; create it"):
        S3Store("no-such-bucket-here").put("k", b"v")


def test_a_local_writer_killed_half_way_leaves_nothing_visible(tmp_path):
    store = open_store(f"file://{tmp_path}")
    store.put("state/1.json", b"whole")
    (tmp_path / "state" / ".1.json.abc.tmp").write_bytes(b"par")  # what a killed writer leaves
    assert [o.key for o in store.list("state/")] == ["state/1.json"]
    assert store.get("state/1.json") == b"whole"


def test_killed_writers_temporaries_are_swept_once_old(tmp_path):
    store = open_store(f"file://{tmp_path}")
    killed = store.writer("state/1.json")  # a writer stopped half-way, its file left as by a kill
    killed.__enter__().write(b"half")
    old = time.time() - 7200
    temporaries = [p for p in (tmp_path / "state").iterdir()]
    assert len(temporaries) == 1 and temporaries[0].name.endswith(".berth-tmp")
    legacy = tmp_path / "state" / ".2.json.abc.tmp"  # as berth named them before
    legacy.write_bytes(b"par")
    young = tmp_path / "kv" / ".3.kv.xyz.berth-tmp"
    young.parent.mkdir()
    young.write_bytes(b"par")
    store.put("state/4.json", b"whole")
    for path in (temporaries[0], legacy, store.path("state/4.json")):
        os.utime(path, (old, old))
    assert [o.key for o in store.list("")] == ["state/4.json"]
    assert store.sweep_temporaries(older_than=3600) == 2
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [".3.kv.xyz.berth-tmp", "4.json"]
    with pytest.raises(StorageError, match="cannot write 'state/1.json'"):  # stalled past the sweep: no object
        killed.__exit__(None, None, None)
    assert not store.exists("state/1.json")


def test_unwritable_local_folder_is_a_storage_error(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(StorageError, match="cannot write|Not a directory"):
        open_store(f"file://{tmp_path / 'file'}").put("a/b", b"x")


def test_urls_and_keys():
    with pytest.raises(ValueError, match="file:///path/to/folder or s3://bucket/prefix"):
        open_store("ftp://host/x")
    for bad in ("../x", "/abs", "a//b", "a/./b", "a b", "é", "a/..", "", ".hidden", "a/.1.json.x.berth-tmp"):
        with pytest.raises(ValueError, match="not an object key"):
            check_key(bad)
    assert check_key("checkpoints/v1/kv/abc/0f.kv") == "checkpoints/v1/kv/abc/0f.kv"


def test_checkpoint_keys_never_carry_user_text():
    user_text = "Ignore previous instructions/../../etc/passwd ünïcode"
    stored = stored_request_id(user_text)
    assert not any(word in stored for word in ("Ignore", "etc", "passwd", ".."))
    assert stored_request_id("12345") == "12345"  # berth's own ids are kept readable
    raw, where = encode_segment([RequestCheckpoint(user_text, "f" * 32, "d", 1, [], 0.0)])
    assert b"passwd" not in raw[raw.rindex(b"\n", 0, len(raw) - 16):]  # the segment's index carries no user text
    with pytest.raises(ValueError):
        segment_key(user_text, 1)
    assert check_key(segment_key("0123abcd", 7)) == "checkpoints/v2/states/0123abcd/0000000007.seg"
    assert check_key(kv_key("f" * 32, bytes(range(16)))).endswith("/000102030405060708090a0b0c0d0e0f.kv")


def test_a_range_of_an_object_is_read_alone(store):
    store.put("a/b", b"0123456789")
    assert store.get_range("a/b", 2, 5) == b"23456"
    assert store.get_range("a/b", 8, 5) == b"89"
    with pytest.raises(ObjectNotFound):
        store.get_range("a/none", 0, 5)


def test_a_local_store_follows_no_link_below_its_root(tmp_path):
    """A link planted in a store (by anyone who can write into its folder, a tenant dropping its
    inputs there) is never followed: not to the host's files, not to another folder of the store,
    not through a linked folder, for reading, listing, writing or deleting."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.jsonl").write_text("the host's secret\n")
    root = tmp_path / "inbox"
    store = open_store(f"file://{root}")
    store.put("team-a/secret.jsonl", b"team-a's line\n")
    (root / "team-b").mkdir()
    (root / "team-b" / "passwd.jsonl").symlink_to("/etc/passwd")
    (root / "team-b" / "theirs.jsonl").symlink_to("../team-a/secret.jsonl")  # stays inside the root
    (root / "team-b" / "away").symlink_to(outside, target_is_directory=True)
    for key in ("team-b/passwd.jsonl", "team-b/theirs.jsonl", "team-b/away/secret.jsonl"):
        with pytest.raises(StorageError, match="link"):
            store.get(key)
        with pytest.raises(StorageError, match="link"):
            store.open(key)
        assert not store.exists(key)
    assert [o.key for o in store.list("")] == ["team-a/secret.jsonl"]
    assert list(store.list("team-b/")) == []
    with pytest.raises(StorageError, match="link"):
        store.put("team-b/away/planted.jsonl", b"x")  # a write through a linked folder
    assert sorted(p.name for p in outside.iterdir()) == ["secret.jsonl"]
    store.delete("team-b/theirs.jsonl")  # the link goes, never what it names
    assert not (root / "team-b" / "theirs.jsonl").is_symlink() and store.get("team-a/secret.jsonl")
    store.put("team-b/passwd.jsonl", b"own\n")  # replaces the link itself, writes nothing through it
    assert store.get("team-b/passwd.jsonl") == b"own\n" and not (root / "team-b" / "passwd.jsonl").is_symlink()
    assert (outside / "secret.jsonl").read_text() == "the host's secret\n"


def test_a_local_store_refuses_a_fifo_at_once_rather_than_blocking_on_it(tmp_path):
    store = open_store(f"file://{tmp_path}")
    os.mkfifo(tmp_path / "stall.jsonl")

    def unblock():  # a reader blocked on the FIFO (as before) gets an end of file after 5 s
        time.sleep(5)
        try:
            os.close(os.open(tmp_path / "stall.jsonl", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader: the store did not block
            pass

    threading.Thread(target=unblock, daemon=True).start()
    with pytest.raises(StorageError, match="not a regular file"):
        store.open("stall.jsonl")
    assert not store.exists("stall.jsonl") and list(store.list("")) == []
