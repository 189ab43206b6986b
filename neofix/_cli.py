"""The ``neofix`` command (console script, and ``python -m neofix``).

Only argparse runs at start-up: ``neofix --help`` answers without importing torch or transformers.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Sequence

from . import _families
from ._version import __version__

DESCRIPTION = textwrap.fill(
    f"neofix makes cached decoding in Hugging Face transformers correct at every step, for "
    f"{_families.count_in_words()} decoder families: {_families.titles()}.",
    92,
    break_on_hyphens=False,  # a family's title stays whole ("GPT-BigCode")
) + "\n`import neofix` is all a program needs; this command checks an installation."

#: The number of scenarios of the full self-check (tests/test_cli.py compares it with the doctor's list).
SCENARIO_COUNT = 13
#: The number of scenarios of each other family's one-line quick self-check (likewise).
QUICK_COUNT = 8

DOCTOR_DESCRIPTION = f"""\
Check that neofix works with the torch and transformers installed here.

It prints the Python, torch, transformers and neofix versions, whether this transformers
release is inside the range neofix is tested against, and each place in every
family's modeling code that neofix patches, with its state (patched / missing /
skipped) and why. It also warns when the unrelated distribution named `neofix` is
installed here (it shares the import name) and says how to repair that.

Then it runs a self-check on a tiny random model of one family (--family, default GPT-Neo:
global and local attention layers, a window shorter than the sequences) built in memory
(nothing is downloaded; it takes seconds), or on a checkpoint folder (--model). Up to
{SCENARIO_COUNT} decoding scenarios - hand-written loops with a stale attention mask, left padding
without position_ids, stale, arange and non-advancing position_ids, a chunked prefill,
four kinds of invalid input, and generate() (greedy, beam search, past the position table
with an EOS in time) - each run twice: first on vanilla transformers (neofix removed with
neofix.unpatch()), then with neofix. Every run is compared token for token with a full
recompute (one forward over the whole sequence, no cache). Scenarios that do not apply to
a family are left out (BLOOM takes no position_ids; GPT-J, CodeGen, GPT-NeoX and the modern
decoders from Llama on use rotary positions, where only their differences matter).

The table shows, per scenario, what vanilla transformers does (an error, "wrong tokens,
no error", or "correct") and what neofix does ("repaired", "clear error: <the
NeofixError subclass>", or "correct"), and whether neofix's result is the expected one:
valid input must give the reference tokens (generate() must also stay token-identical to
vanilla), invalid input must raise a NeofixError. Without --model, every other family
then gets a quick self-check of {QUICK_COUNT} scenarios on its own tiny model, one line each.

The process is left as the doctor found it (patch state, settings, warning filters)."""

DOCTOR_EPILOG = """\
exit status:
  0  every neofix verdict is as expected
  1  at least one is not (the table marks it WRONG)
  2  usage error: an unknown option or family, --model is not a checkpoint folder of the
     chosen family (no config.json, another model_type, too small, unreadable weights),
     or this transformers cannot load that family

examples:
  neofix doctor
  neofix doctor --strict
  neofix doctor --family gpt2
  neofix doctor --family gpt_neo --model ./my-gpt-neo --json > doctor.json"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neofix", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"neofix {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    doctor = commands.add_parser(
        "doctor",
        help="check this installation: versions, patch state, and what neofix fixes on it, for every family",
        description=DOCTOR_DESCRIPTION,
        epilog=DOCTOR_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.set_defaults(command_parser=doctor)  # main() reports an option unknown to doctor with doctor's usage
    doctor.add_argument(
        "--family",
        metavar="NAME",
        default="gpt_neo",
        help=f"the model family whose full self-check table is shown (default gpt_neo; one of: "
        f"{', '.join(_families.FAMILIES)}); the other families get a one-line quick self-check each",
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


def name_clash() -> str | None:
    """What to do about the unrelated distribution named ``neofix``, when installed metadata shows one; else None.

    Read with importlib.metadata, never by importing anything of that package, and independent of
    ``neofix/__init__.py`` (which that distribution overwrites when it is installed after this one).
    """
    try:
        from importlib import metadata

        for distribution in metadata.distributions():
            name = (distribution.metadata["Name"] or "").strip().lower().replace("_", "-").replace(".", "-")
            if name != "neofix":
                continue
            where = distribution.locate_file("")
            return (
                f"the unrelated distribution 'neofix' {distribution.version} is installed in {where}. It is not "
                f"transformers-neofix, but it installs an import package named `neofix` too: each overwrites the "
                f"other's files, and uninstalling either deletes files of both. To repair, uninstall it first, then "
                f"reinstall this one: `pip uninstall neofix`, then `pip install --force-reinstall transformers-neofix` "
                f"(from a checkout: `pip install --force-reinstall .`). Until then run `python -m neofix doctor`: "
                f"the `neofix` command may be the other package's."
            )
    except Exception:  # noqa: BLE001 - a check that cannot run says nothing
        return None
    return None


def _doctor(args: argparse.Namespace) -> int:
    from . import _doctor
    from ._doctor import _report

    def progress(message: str) -> None:
        print(f"neofix doctor: {message}", file=sys.stderr, flush=True)

    clash = name_clash()
    if clash is not None:  # first, before anything that the other package's files may break
        print(f"neofix doctor: WARNING: {clash}", file=sys.stderr, flush=True)
    try:
        report = _doctor.run(model_path=args.model, strict=args.strict, progress=progress, family=args.family)
    except _doctor.DoctorUsageError as exc:
        print(f"neofix doctor: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("neofix doctor: interrupted", file=sys.stderr)
        return 130
    report = report._replace(name_clash=clash)
    print(_report.as_json(report) if args.json else _report.as_table(report), flush=True)
    return report.exit_status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
