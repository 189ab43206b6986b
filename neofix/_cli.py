"""The ``neofix`` command (console script, and ``python -m neofix``).

Only argparse runs at start-up: ``neofix --help`` answers without importing torch or transformers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ._version import __version__

DESCRIPTION = """\
neofix makes GPT-Neo text generation in Hugging Face transformers correct at every decoding step.
`import neofix` is all a program needs; this command checks an installation."""

DOCTOR_DESCRIPTION = """\
Check that neofix works with the torch and transformers installed here.

It prints the Python, torch, transformers and neofix versions, whether this transformers
release is inside the range neofix is tested against, and each place in GPT-Neo that
neofix patches, with its state (patched / missing / skipped) and why.

Then it runs a self-check on a tiny random GPT-Neo built in memory (nothing is
downloaded; it takes seconds). Ten decoding scenarios - hand-written loops with a stale
attention mask, left padding without position_ids, stale position_ids, chunked prefill,
invalid inputs, and generate() - each run twice: first on vanilla transformers (neofix
removed with neofix.unpatch()), then with neofix. Every run is compared token for token
with a full recompute (one forward over the whole sequence, no cache).

The table shows, per scenario, what vanilla transformers does (an error, "wrong tokens,
no error", or "correct") and what neofix does ("repaired", "clear error: <the
NeofixError subclass>", or "correct"), and whether neofix's result is the expected one:
valid input must give the reference tokens (generate() must also stay token-identical to
vanilla), invalid input must raise a NeofixError.

The process is left as the doctor found it (patch state, settings, warning filters)."""

DOCTOR_EPILOG = """\
exit status:
  0  every neofix verdict is as expected
  1  at least one is not (the table marks it WRONG)
  2  usage error: an unknown option, or --model is not a GPT-Neo checkpoint folder

examples:
  neofix doctor
  neofix doctor --strict
  neofix doctor --model ./my-gpt-neo --json > doctor.json"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neofix", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"neofix {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    doctor = commands.add_parser(
        "doctor",
        help="check this installation: versions, patch state, and what neofix fixes on it",
        description=DOCTOR_DESCRIPTION,
        epilog=DOCTOR_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.set_defaults(command_parser=doctor)  # main() reports an option unknown to doctor with doctor's usage
    doctor.add_argument(
        "--family",
        metavar="NAME",
        default="gpt_neo",
        help="the model family whose full self-check table is shown (default gpt_neo; one of: gpt_neo, gpt2, gptj, "
        "codegen, gpt_neox, opt, bloom); the other families get a one-line quick self-check each",
    )
    doctor.add_argument(
        "--model",
        metavar="PATH",
        help="run the self-check on a checkpoint folder of the family on this machine (what save_pretrained writes: "
        "config.json and the weights) instead of the tiny model; loaded with local_files_only=True, on the CPU, "
        "in float32",
    )
    doctor.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document on stdout instead of the table (progress still goes to stderr)",
    )
    doctor.add_argument(
        "--strict",
        action="store_true",
        help="run neofix in strict mode: steps it would repair (a stale mask, stale position_ids) must then raise "
        "a NeofixError; steps that need no repair must still give the reference tokens",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    # parse_args would report an argument unknown to a command with the top-level usage: the command's says more
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # the top level takes no option values, so what follows the command's name is the command's
        of_command = args.command is not None and unknown[0] not in argv[: argv.index(args.command)]
        failed = args.command_parser if of_command else parser
        failed.error(f"unrecognized arguments: {' '.join(unknown)}")  # prints its usage, exits with status 2
    if args.command is None:
        parser.print_help(sys.stderr)
        print("\nneofix: error: name a command, e.g. 'neofix doctor'", file=sys.stderr)
        return 2
    return _doctor(args)


def _doctor(args: argparse.Namespace) -> int:
    from . import _doctor
    from ._doctor import _report

    def progress(message: str) -> None:
        print(f"neofix doctor: {message}", file=sys.stderr, flush=True)

    try:
        report = _doctor.run(model_path=args.model, strict=args.strict, progress=progress, family=args.family)
    except _doctor.DoctorUsageError as exc:
        print(f"neofix doctor: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("neofix doctor: interrupted", file=sys.stderr)
        return 130
    print(_report.as_json(report) if args.json else _report.as_table(report), flush=True)
    return report.exit_status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
