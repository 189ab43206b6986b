"""``neofix doctor``: versions, patch state, and a self-check of vanilla transformers against neofix.

Private: the command line (:mod:`neofix._cli`) is the interface.  :func:`run` returns a :class:`Report`; it
imports torch and transformers, so nothing imports this module at ``import neofix`` time.

The self-check runs every scenario of :mod:`._scenarios` twice, first with neofix removed (``neofix.unpatch()``)
and then with it installed, and judges both runs against the full-recompute reference.  The process is left as
it was found: patch state, neofix's settings and reported repairs, warning filters, transformers' log level.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import platform
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

from .. import _config, _lifecycle
from .._errors import NeofixError
from .._version import __version__

__all__ = ["DoctorUsageError", "Report", "Row", "run"]

_SMALL_MODEL = 20_000_000  # parameters; below this the self-check runs on one CPU thread


class DoctorUsageError(Exception):
    """The doctor cannot run as asked (an unknown family, a ``--model`` path that is not a checkpoint of the family,
    a family this transformers cannot load): exit status 2."""


class Cell(NamedTuple):
    """One column of one scenario: what happened, in words for the table and as a kind for JSON."""

    kind: str  # correct | repaired | wrong_tokens | accepted | clear_error | error | not_patched | no_reference
    text: str
    error_class: str | None = None
    message: str | None = None  # the full first line of the error, for JSON


class Row(NamedTuple):
    key: str
    title: str
    vanilla: Cell
    neofix: Cell
    expected: str  # in words: "reference tokens", "reference tokens, identical to vanilla", "clear error: X"
    right: bool


class Report(NamedTuple):
    versions: dict[str, str]
    tested_range: str
    supported: bool
    found_patched: bool
    targets: list[tuple[str, str, str]]
    mode: str
    model: dict[str, Any]
    rows: list[Row]
    seconds: float
    family: str = "gpt_neo"
    #: the other families' quick self-checks: (family title, its rows), or (title, reason it did not run)
    others: tuple[tuple[str, Any], ...] = ()
    #: what to do about the unrelated distribution named ``neofix`` installed here (``neofix._cli.name_clash``)
    name_clash: str | None = None

    @property
    def all_right(self) -> bool:
        others = [rows for _, rows in self.others if not isinstance(rows, str)]
        return bool(self.rows) and all(row.right for row in self.rows) and all(r.right for rows in others for r in rows)

    @property
    def exit_status(self) -> int:
        return 0 if self.all_right else 1


#: The scenarios of the one-line self-check of the other families (the full table for one: --family NAME).
QUICK = (
    "stale_mask",
    "padded_no_positions",
    "stale_positions",
    "mask_too_long",
    "batch_mismatch",
    "position_overflow",
    "out_of_vocabulary",
    "generate_greedy",
)


def run(
    model_path: str | None = None,
    strict: bool = False,
    progress: Callable[[str], None] = lambda _: None,
    family: str = "gpt_neo",
    others: bool = True,
) -> Report:
    """Run the doctor; raise :class:`DoctorUsageError` when ``model_path`` is not a checkpoint of ``family``.

    The self-check runs on a tiny random model of ``family`` (or the checkpoint), one row per scenario; with
    ``others``, every other family transformers has gets a quick self-check on its tiny model too, one line each.
    """
    from .._families import FAMILIES

    started = time.perf_counter()
    _check_arguments(model_path, family)  # before the slow imports: a typo is reported at once
    progress("loading torch and transformers")
    with _quiet_imports():
        import torch
        import transformers

        from .. import _compat

    chosen = FAMILIES[family]
    if not chosen.patched_here():
        raise DoctorUsageError(f"--family {family}: {chosen.targets[0].why}")
    _load_families(chosen, transformers.__version__, others and model_path is None)
    found_patched = _lifecycle.is_patched()
    with _preserved_state(transformers):
        model, described = _load_model(model_path, progress, family)
        targets = _lifecycle.status()  # as neofix installs them for its column (installed above if it was not)
        patched = _lifecycle.is_patched()
        _settle_for_the_check(model, strict)
        from ._scenarios import Context

        context = Context(model, chosen.load_adapter())
        described.update(_describe_context(context))
        rows = _self_check(context, patched, strict, progress)
        found = []
        if others and model_path is None:
            found = [(other.title, _quick_check(other, patched, strict, progress)) for other in FAMILIES.values()
                     if other is not chosen]

    versions = {"python": platform.python_version(), "torch": str(torch.__version__),
                "transformers": str(transformers.__version__), "neofix": __version__}
    return Report(
        versions=versions,
        tested_range=_compat.SUPPORTED_TRANSFORMERS,
        supported=_compat.is_supported(versions["transformers"]),
        found_patched=found_patched,
        targets=targets,
        mode="strict" if strict else "repair",
        model=described,
        rows=rows,
        seconds=round(time.perf_counter() - started, 2),
        family=family,
        others=tuple(found),
    )


def _settle_for_the_check(model: Any, strict: bool) -> None:
    """The doctor's own settings for its column: the mode asked for, no value reads; one thread for a tiny model."""
    import torch

    _config.configure(mode="strict" if strict else "repair", check_values=False)
    if sum(p.numel() for p in model.parameters()) < _SMALL_MODEL:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads; on a busy machine they cost seconds


def _load_families(chosen: Any, version: str, others: bool) -> None:
    """Import the chosen family's modeling module (neofix's import hook patches it there, as in a user's program),
    and with ``others`` every other family's (their targets are listed too)."""
    from .. import _compat
    from .._families import FAMILIES

    try:
        with _quiet_imports():
            importlib.import_module(chosen.module)  # neofix's import hook patches it here, as in a user's program
    except Exception as exc:
        raise DoctorUsageError(
            f"transformers {version} cannot load {chosen.title} ({_one_line(exc)}); "
            f"reinstall transformers (neofix is tested with {_compat.SUPPORTED_TRANSFORMERS})"
        ) from exc
    if others:
        for other in FAMILIES.values():
            with contextlib.suppress(Exception), _quiet_imports():
                importlib.import_module(other.module)


def _self_check(
    context: Any, patched: bool, strict: bool, progress: Callable[[str], None], keys: tuple[str, ...] | None = None
) -> list[Row]:
    """Every scenario (or those of ``keys``) on vanilla transformers, then with neofix, judged against the reference."""
    from ._scenarios import SCENARIOS

    chosen = [scenario for scenario in SCENARIOS if keys is None or scenario.key in keys]
    rows = []
    for number, scenario in enumerate(chosen, 1):
        if keys is None:
            progress(f"[{number:2d}/{len(chosen)}] {scenario.title}")
        scenario = scenario.for_family(context)
        if isinstance(scenario, str):
            continue  # does not apply to this family (say, positions to a model that takes none)
        with _lifecycle.unpatched():
            reference = None
            if scenario.reference is not None:  # computed on vanilla transformers, with the patch off
                computed = _attempt(scenario.reference, context)
                if computed.error is not None:
                    rows.append(_unjudged(scenario, computed.error))
                    continue
                reference = computed.tokens
            vanilla = _attempt(scenario.run, context)
        with_neofix = _attempt(scenario.run, context) if patched else None
        rows.append(_judge(scenario, reference, vanilla, with_neofix, strict))
    return rows


def _quick_check(family: Any, patched: bool, strict: bool, progress: Callable[[str], None]) -> Any:
    """The quick self-check of another family on its tiny model: its rows, or why it did not run."""
    from ..testing import FAMILY_CONFIGS, tiny_model
    from ._scenarios import Context

    if family.name not in FAMILY_CONFIGS:
        return "no tiny model"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(family.module)
            model = tiny_model(family.name)
    except Exception as exc:  # noqa: BLE001 - a family this release lacks, or cannot build: said, not raised
        return f"not available on this transformers ({_one_line(exc, limit=80)})"
    if not family.patched_here():
        return family.targets[0].why
    progress(f"{family.title}: quick self-check")
    return _self_check(Context(model, family.load_adapter()), patched, strict, progress, QUICK)


# --- state -------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_imports() -> Iterator[None]:
    """What importing torch, transformers and the modeling modules says is not the doctor's business: deprecation
    notices (transformers 4.36 - 4.40 on a newer torch), and log lines of warning level or below (transformers 5.25
    and later look for flash-attention kernels on the Hub when a modeling module loads, and say when offline mode
    skips their check).  An unsupported release is reported in the doctor's own words; errors are still logged."""
    disabled = logging.root.manager.disable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(max(disabled, logging.WARNING))
        try:
            yield
        finally:
            logging.disable(disabled)


@contextlib.contextmanager
def _preserved_state(transformers: Any) -> Iterator[None]:
    """Silence vanilla's and neofix's warnings while the self-check runs; afterwards put everything back: the patch
    state and the repairs already reported (``neofix.patched()``), settings, log levels, grad mode, threads."""
    import torch

    settings = _config.configure()  # no arguments: reads without changing
    verbosity = transformers.logging.get_verbosity()
    grad = torch.is_grad_enabled()
    threads = torch.get_num_threads()
    step_log = logging.getLogger("neofix")  # NEOFIX_TRACE=1 logs every step there: not during the self-check
    step_log_disabled = step_log.disabled
    try:
        with warnings.catch_warnings(), _lifecycle.patched():
            warnings.simplefilter("ignore")
            transformers.logging.set_verbosity_error()
            step_log.disabled = True
            torch.set_grad_enabled(False)
            yield
    finally:
        torch.set_grad_enabled(grad)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        transformers.logging.set_verbosity(verbosity)
        step_log.disabled = step_log_disabled
        _config.configure(**settings)


# --- the model ---------------------------------------------------------------------------------------------------


def _check_arguments(model_path: str | None, family: str) -> None:
    """Raise :class:`DoctorUsageError` for a family neofix does not know, or a ``model_path`` that is no checkpoint."""
    from .._families import FAMILIES

    if family not in FAMILIES:
        raise DoctorUsageError(f"--family {family}: no such family; choose from {', '.join(FAMILIES)}")
    if model_path is not None:
        _check_model_directory(model_path)


def _check_model_directory(path: str) -> None:
    directory = Path(path)
    if not directory.exists():
        raise DoctorUsageError(
            f"--model {path}: no such directory. Pass a folder on this machine holding a checkpoint of the family "
            f"(what model.save_pretrained(folder) writes: config.json and the weights); nothing is downloaded"
        )
    if not directory.is_dir():
        raise DoctorUsageError(
            f"--model {path}: this is a file; pass the checkpoint's folder (the one holding config.json)"
        )
    if not (directory / "config.json").is_file():
        raise DoctorUsageError(
            f"--model {path}: no config.json in this folder, so it is not a saved checkpoint. Pass the folder "
            f"that model.save_pretrained(folder) wrote"
        )


def _load_model(
    path: str | None, progress: Callable[[str], None], family: str = "gpt_neo"
) -> tuple[Any, dict[str, Any]]:
    import torch

    if path is None:
        from .._families import FAMILIES
        from ..testing import tiny_model

        title = FAMILIES[family].title
        progress(f"building the tiny random {title}")
        # for GPT-Neo, gpt-neo-125M's structure shrunk: global and local attention layers alternate, and the local
        # window (4) is shorter than every sequence the scenarios decode, so each of them crosses it
        model = tiny_model(family, seed=0, dtype=torch.float32)
        return model, {"source": f"built-in tiny random {title} (no download)", "family": family}
    progress(f"loading {path}")
    from transformers import AutoConfig, AutoModelForCausalLM

    from .._families import FAMILIES
    from ._scenarios import ROW_LENGTHS, STEPS, _table_size

    title = FAMILIES[family].title
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise DoctorUsageError(f"--model {path}: cannot read its config.json ({_one_line(exc)})") from exc
    kind = getattr(config, "model_type", None) or "unknown"
    if kind != family:  # the families' names are their model types
        architectures = ", ".join(getattr(config, "architectures", None) or ()) or "no architectures listed"
        hint = (
            f"pass --family {kind} for it"
            if kind in FAMILIES
            else f"neofix patches {', '.join(f.title for f in FAMILIES.values())}"
        )
        raise DoctorUsageError(
            f"--model {path}: this is a {kind!r} checkpoint ({architectures}), not {title}: {hint} (the folder's "
            f"config.json says \"model_type\": {kind!r})"
        )
    needed = max(ROW_LENGTHS) + STEPS + 2
    if _table_size(config) < needed or config.vocab_size < 2:
        raise DoctorUsageError(
            f"--model {path}: this {title} is too small for the self-check (position table "
            f"{_table_size(config)}, vocab_size {config.vocab_size}; it needs at least {needed} positions and 2 "
            f"token ids)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise DoctorUsageError(f"--model {path}: cannot load the weights ({_one_line(exc)})") from exc
    # float32 on the CPU, whatever the checkpoint was saved in: half precision would make token comparisons flaky
    return model.to(device="cpu", dtype=torch.float32).eval(), {"source": f"checkpoint {Path(path)}", "family": family}


def _describe_context(context: Any) -> dict[str, Any]:
    from ._scenarios import ROW_LENGTHS, STEPS

    config = context.model.config
    layers = list(getattr(config, "attention_layers", []) or [])
    longest = max(ROW_LENGTHS) + STEPS
    window = int(getattr(config, "window_size", 0) or 0)
    return {
        "layers": len(layers) or int(config.num_hidden_layers),
        "attention_layers": layers,
        "window_size": window,
        "vocab_size": context.vocab_size,
        "max_position_embeddings": context.limit,  # None: no position table (BLOOM)
        "dtype": str(next(context.model.parameters()).dtype).replace("torch.", ""),
        "prompt_lengths": list(ROW_LENGTHS),
        "new_tokens": STEPS,
        "local_window_crossed": "local" in layers and longest > window,
    }


# --- verdicts ----------------------------------------------------------------------------------------------------


class _Outcome(NamedTuple):
    tokens: Any  # a tensor, or None when it raised
    error: BaseException | None


def _attempt(function: Callable[[Any], Any], context: Any) -> _Outcome:
    try:
        return _Outcome(function(context), None)
    except Exception as exc:  # noqa: BLE001 - every failure is an outcome to report, never a crash of the doctor
        return _Outcome(None, exc)


def _same(tokens: Any, expected: Any) -> bool:
    import torch

    return tokens is not None and expected is not None and tokens.shape == expected.shape and bool(
        torch.equal(tokens, expected)
    )


def _judge(scenario: Any, reference: Any, vanilla: _Outcome, with_neofix: _Outcome | None, strict: bool) -> Row:
    vanilla_correct = vanilla.error is None and _same(vanilla.tokens, reference)
    if vanilla.error is not None:
        vanilla_cell = _error_cell(vanilla.error)
    elif scenario.error is not None or reference is None:  # invalid input, taken without a word
        vanilla_cell = _accepted(vanilla.tokens, reference)
    elif vanilla_correct:
        vanilla_cell = Cell("correct", "correct")
    else:
        vanilla_cell = Cell("wrong_tokens", "wrong tokens, no error")

    error = scenario.expected_error(strict)
    if error is not None:
        expected = f"clear error: {error.__name__}"
    elif scenario.parity:
        expected = "reference tokens, identical to vanilla"
    else:
        expected = "reference tokens"

    if with_neofix is None:
        return Row(scenario.key, scenario.title, vanilla_cell, Cell("not_patched", "not patched"), expected, False)
    if with_neofix.error is not None:
        cell = _error_cell(with_neofix.error)
        right = error is not None and isinstance(with_neofix.error, error)
    else:
        matches = _same(with_neofix.tokens, reference)
        if scenario.parity:
            matches = matches and vanilla.error is None and _same(with_neofix.tokens, vanilla.tokens)
        if error is not None or reference is None:
            cell = _accepted(with_neofix.tokens, reference)
        elif not matches:
            text = _parity_text(with_neofix.tokens, reference) if scenario.parity else "wrong tokens, no error"
            cell = Cell("wrong_tokens", text)
        elif vanilla_correct:
            cell = Cell("correct", "correct")
        else:
            cell = Cell("repaired", "repaired")
        right = error is None and matches
    return Row(scenario.key, scenario.title, vanilla_cell, cell, expected, right)


def _unjudged(scenario: Any, error: BaseException) -> Row:
    """The full-recompute reference itself failed: nothing can be judged (and that is not right)."""
    cell = Cell("no_reference", f"no reference: {shorten_error(error, 52)}", type(error).__name__, _one_line(error))
    return Row(scenario.key, scenario.title, cell, cell, "a full-recompute reference", False)


def _accepted(tokens: Any, reference: Any) -> Cell:
    if reference is None:
        return Cell("accepted", "accepted, no error")
    if _same(tokens, reference):
        return Cell("accepted", "accepted, no error (tokens as intended)")
    return Cell("accepted", "accepted, no error (wrong tokens)")


def _parity_text(tokens: Any, reference: Any) -> str:
    if not _same(tokens, reference):
        return "wrong tokens, no error"
    return "differs from vanilla"


def _error_cell(error: BaseException) -> Cell:
    name = type(error).__name__
    if isinstance(error, NeofixError):
        return Cell("clear_error", f"clear error: {name}", name, _one_line(error, limit=None))
    return Cell("error", shorten_error(error), name, _one_line(error, limit=None))


_REWRITES = (
    # "The size of tensor a (6) must match the size of tensor b (5) at non-singleton dimension 3"
    (
        r"The size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\).*",
        r"size of tensor a (\1) must match b (\2)",
    ),
)


def shorten_error(error: BaseException, limit: int = 66) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters (a table cell)."""
    import re

    message = _one_line(error, limit=None)
    for pattern, replacement in _REWRITES:
        message = re.sub(pattern, replacement, message)
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def _one_line(error: BaseException, limit: int | None = 200) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    message = lines[0] if lines else ""
    if limit is not None and len(message) > limit:
        message = message[: limit - 3] + "..."
    return message
