"""The ``berth`` command line. Every engine flag maps to a field of ``worker.config.Settings`` and
can also be set as a ``BERTH_*`` environment variable; a flag wins over the environment."""

from __future__ import annotations

import sys

import click
from pydantic import ValidationError

from worker.config import ConfigError, Settings


def engine_options(command):
    """The engine's flags, shared by every command that runs an engine."""
    options = [
        click.option("--model", help="GGUF file or Hugging Face safetensors folder [default: SmolLM2-135M-Instruct]"),
        click.option("--model-name", help="the name requests give in body.model [default: from the model]"),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"])),
        click.option("--device", help="auto, cpu, cuda or cuda:N"),
        click.option("--threads", type=int, help="CPU threads [default: all cores]"),
        click.option("--kv-memory", help="KV cache size: bytes (2GiB, 512MB) or a fraction of free memory (0.25)"),
        click.option("--block-size", type=int, help="tokens per KV block [16]"),
        click.option("--max-num-batched-tokens", "--token-budget", "max_num_batched_tokens", type=int,
                     help="tokens computed per step [2048]"),
        click.option("--max-num-seqs", type=int, help="cap on running sequences [256]"),
        click.option("--attention-backend", type=click.Choice(["auto", "torch", "triton"])),
        click.option("--no-prefix-cache", "enable_prefix_cache", flag_value=False, default=None,
                     help="turn the prefix cache off"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def settings_from(flags: dict) -> Settings:
    """Settings from the environment, overridden by the flags that were given."""
    given = {k: v for k, v in flags.items() if v is not None and k in Settings.model_fields}
    try:
        return Settings(**given)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors())
        raise click.UsageError(f"bad setting: {problems}") from None


@click.group()
def main():
    """berth: bulk LLM inference with continuous batching over a paged KV cache."""


@main.command()
@click.argument("input_file", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="output JSONL file")
@click.option("--errors", type=click.Path(dir_okay=False), help="errors JSONL [default: OUTPUT.errors.jsonl]")
@click.option("--quiet", is_flag=True, help="no progress bar")
@engine_options
def generate(input_file, output, errors, quiet, **flags):
    """Run an OpenAI Batch request file through the engine in this process."""
    from jobs.generate import generate_file
    from worker.engine import RequestRejected
    from worker.model_loader import ModelLoadError

    settings = settings_from(flags)
    try:
        summary = generate_file(input_file, output, settings, errors_path=errors, progress=not quiet)
    except (ConfigError, ModelLoadError, RequestRejected) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{summary.completed} completed, {summary.failed} failed of {summary.total} requests; "
               f"{summary.output_tokens} output tokens in {summary.seconds:.1f}s "
               f"({summary.output_tokens_per_second:.1f} tok/s) -> {summary.output_path}", err=True)
    if summary.errors_path:
        click.echo(f"errors: {summary.errors_path}", err=True)


if __name__ == "__main__":
    sys.exit(main())
