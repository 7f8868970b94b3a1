"""The ``kvqref`` command line."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from kvqref import formats
from kvqref.calibration.command import CalibrationError
from kvqref.calibration.command import add_parser as add_calibrate_parser


def _bits_hex(codec: formats.MinifloatCodec, code: int) -> str:
    s = codec.spec
    bits = format(code, f"0{s.bits}b")
    sign = bits[0] + "." if s.signed else ""
    rest = bits[1:] if s.signed else bits
    mant = "." + rest[s.ebits:] if s.mbits else ""
    return f"0x{code:02X} ({sign}{rest[:s.ebits]}{mant})"


def formats_table() -> str:
    """Markdown table of every element format: bits, bias, range, and what overflow and NaN do."""
    head = ["format", "bits", "E", "M", "bias", "max finite", "max code", "min normal", "min subnormal",
            "overflow (saturate)", "overflow (no saturate)", "+-Inf (no saturate)", "NaN in", "-0"]
    rows = []
    for name in formats.names():
        c = formats.get(name)
        d = c.describe()
        rows.append([name, str(c.bits), str(c.spec.ebits), str(c.spec.mbits), str(c.bias), f"{c.max_finite:g}",
                     _bits_hex(c, c.spec.max_code), f"2^{c.spec.emin} = {c.min_normal:.6g}",
                     f"{c.min_subnormal:.6g}" if c.spec.subnormals else "none",
                     d["overflow, saturate=True"], d["overflow, saturate=False"], d["+-Inf, saturate=False"],
                     d["NaN"], d["-0"]])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def _cmd_formats(args: argparse.Namespace) -> int:
    print(formats_table())
    print("\nRounding: to nearest, ties to even, one rounding from the exact input (E8M0: floor, ceil or nearest,"
          " chosen by the caller). Details: docs/formats.md")
    return 0


def _cmd_vectors(args: argparse.Namespace) -> int:
    from kvqref import vectors

    path = vectors.write(args.out)
    print(f"wrote {path}")
    return 0


class UsageError(Exception):
    """A mistake the person running the command can fix: printed without a traceback, exit status 2."""


def _gpu_reason() -> str | None:
    """None if torch sees a CUDA or ROCm GPU, else why not."""
    from kvqref.backends import _gpu

    kind, desc = _gpu()
    return None if kind else desc


def _backend_names(requested: Sequence[str] | None) -> list[str] | None:
    from kvqref import backends

    if not requested:
        return None
    names = [n.strip() for item in requested for n in item.split(",") if n.strip()]
    for n in names:
        if n not in backends.names():
            raise UsageError(f"unknown backend {n!r}; known backends: {', '.join(backends.names())}")
        why = backends.available()[n]
        if why:
            raise UsageError(f"backend {n!r} is unavailable here: {why}")
    return names


def _cmd_report(args: argparse.Namespace) -> int:
    from kvqref import report

    names = _backend_names(args.backend)
    if args.speed and _gpu_reason():
        raise UsageError(f"--speed needs a GPU, and this machine has none ({_gpu_reason()}); "
                         "leave it out to get every other section on the CPU")
    report.run(Path(args.out), quick=args.quick, backends_=names, want_speed=False if args.no_speed else None,
               llm=False if args.no_llm else None)
    return 0


def _cmd_claims(args: argparse.Namespace) -> int:
    from kvqref import report

    report.run_claims(Path(args.out), quick=args.quick)
    return 0


def _float_list(text: str, name: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{name} must be comma-separated numbers, got {text!r}") from None


def _cmd_eval_scales(args: argparse.Namespace) -> int:
    """``kvqref eval --scales``: :mod:`kvqref.eval.scales` (its own options: python -m kvqref.eval.scales)."""
    from kvqref.eval import scales

    other = [f"--{k.replace('_', '-')}" for k in ("schemes", "json", "prompts", "gen_tokens", "passkey_tokens",
                                                   "depths") if getattr(args, k) is not None]
    other += [f"--{k}" for k in ("quick", "no_builtin") if getattr(args, k)]
    other += ["--rotation"] if args.rotation != "none" else []
    if other:
        raise UsageError(f"{', '.join(other)}: not used with --scales (it writes --markdown OUT and a .json "
                         "beside it; more options: python -m kvqref.eval.scales --help)")
    if not args.markdown:
        raise UsageError("--scales needs --markdown OUT (the results file; a .json is written beside it)")
    argv = ["--out", args.markdown]
    for opt, val in (("--text", args.text), ("--eval-tokens", args.tokens), ("--threads", args.threads)):
        if val is not None:
            argv += [opt, str(val)]
    return scales.main(argv, command="kvqref " + shlex.join(args.argv))


def _cmd_eval(args: argparse.Namespace) -> int:
    if args.scales:
        return _cmd_eval_scales(args)
    from kvqref.eval import llm

    default = llm.QUICK_CONFIGS if args.quick else (
        llm.ROTATION_CONFIGS if args.rotation != "none" else [c.label for c in llm.CONFIGS])
    try:
        configs = llm.configs_named([n.strip() for n in args.schemes.split(",") if n.strip()]) if args.schemes \
            else llm.configs_named(default)
        configs = llm.with_rotation(configs, args.rotation)
    except ValueError as e:
        raise UsageError(str(e)) from None
    base = llm.QUICK if args.quick else llm.FULL
    changes = {k: v for k, v in (("tokens", args.tokens), ("prompts", args.prompts), ("gen_tokens", args.gen_tokens),
                                 ("passkey_tokens", args.passkey_tokens)) if v is not None}
    if args.depths is not None:
        changes["depths"] = _float_list(args.depths, "--depths")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    try:
        settings = llm.Settings(**{**base.__dict__, **changes})
    except ValueError as e:
        raise UsageError(str(e)) from None
    text = text_name = None
    if args.text:
        path = Path(args.text)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"--text: no such file: {path}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--text: cannot read {path} as UTF-8 text: {e}") from None
        text_name = f"{path.name} (--text)"
    why = llm.unavailable_reason()
    if why:
        raise UsageError(why)
    from kvqref.report import llm as llm_section
    from kvqref.report.progress import Progress

    print(f"loading SmolLM2-135M-Instruct ({len(configs)} configuration(s); {llm.describe(settings)})",
          file=sys.stderr)
    model, tok = llm.load_model()
    try:
        res = llm.evaluate(model, tok, configs, settings, text=text, text_name=text_name,
                           progress=Progress(llm.steps(configs, settings), "eval"), threads=args.threads)
    except llm.TextTooShort as e:
        raise UsageError(str(e)) from None
    if not args.no_builtin:
        from kvqref.eval import builtin_caches

        res["builtin"] = builtin_caches.compare(model, tok, builtin_caches.QUICK if args.quick else builtin_caches.FULL,
                                                text=text, threads=args.threads)
    res["command"] = "kvqref " + shlex.join(args.argv)
    md = llm_section.markdown_tables(res)
    print(md)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(llm_section.to_json(res))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.markdown:
        md_path = Path(args.markdown)
        md_path.parent.mkdir(parents=True, exist_ok=True)
        pngs = llm_section.plot(md_path.parent, res["rows"], f"{md_path.stem}_kl.png")
        tables = []
        if args.rotation == "both":  # the with/without table as CSV/JSON/LaTeX too, and its plot first
            from kvqref.report import llm_rotation

            pngs = llm_rotation.write(md_path.parent, res, f"{md_path.stem}_table", f"{md_path.stem}.png")[1] + pngs
            tables = [f"{md_path.stem}_table.{ext}" for ext in ("csv", "json", "tex")]
        md_path.write_text(llm_section.markdown_document(res, pngs))
        print(f"wrote {args.markdown}" + "".join(f", {md_path.parent / p}" for p in pngs + tables), file=sys.stderr)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from kvqref import conformance, report

    (name,) = _backend_names([args.backend]) or [args.backend]
    results = conformance.check(name, quick=not args.full,
                                progress=report.Progress(conformance.expected_count(name), f"check {name}"))
    for r in results:
        print(f"{'PASS' if r.passed else 'FAIL'}  {r.check:9s} {r.case}: {r.detail}")
    s = conformance.summary(results).get(name, {"passed": 0, "failed": 0})
    print(f"{name}: {s['passed']} passed, {s['failed']} failed")
    return 0 if s["failed"] == 0 else 1


def _cmd_capacity(args: argparse.Namespace) -> int:
    from kvqref import capacity, report, schemes

    try:
        mem = capacity.parse_memory(args.memory)
    except ValueError as e:
        raise UsageError(str(e)) from None
    entries: list = list(report.CAPACITY_SCHEMES)
    if args.schemes:
        entries = [n.strip() for n in args.schemes.split(",") if n.strip()]
        for n in entries:
            if schemes.ALIASES.get(n, n) not in schemes.names():
                raise UsageError(f"unknown KV cache scheme {n!r}; known schemes: "
                                 f"{', '.join([*schemes.names(), *schemes.ALIASES])}")
    for nm, val in (("--layers", args.layers), ("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim)):
        if val <= 0:
            raise UsageError(f"{nm} must be a positive integer, got {val}")
    try:
        rows = report.capacity_rows(mem, args.layers, args.kv_heads, args.head_dim, entries, args.num_seqs)
    except ValueError as e:
        raise UsageError(str(e)) from None
    cols = ("scheme", "bits/elem with scales", "bytes/token (all layers, K+V)", "tokens", "x BF16 (tokens)",
            "x FP8 (tokens)")
    print(f"Tokens of K+V cache in {args.memory} ({mem:,} bytes), {args.layers} layers, {args.kv_heads} KV heads, "
          f"head_dim {args.head_dim}, {args.num_seqs} sequence(s) (KIVI residual windows reserved):\n")
    print(report.markdown(rows, cols))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvqref", description="Reference codecs and kernels for quantized KV caches")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="the main job: formats, accuracy study, conformance, speed (GPU); writes a "
                                      "folder of markdown, CSV, JSON, LaTeX and PNG")
    r.add_argument("--out", default="kvqref-report", help="output folder (default: ./kvqref-report)")
    r.add_argument("--quick", action="store_true", help="a reduced run (CI smoke test, < 1 minute)")
    r.add_argument("--backend", action="append", metavar="NAME",
                   help="backends to check for conformance (repeat or comma-separate; default: every available)")
    sp = r.add_mutually_exclusive_group()
    sp.add_argument("--speed", action="store_true", help="require the speed section (GPU only)")
    sp.add_argument("--no-speed", action="store_true", help="skip the speed section even on a GPU")
    r.add_argument("--no-llm", action="store_true", help="skip the decoder-LLM section (SmolLM2-135M)")
    r.set_defaults(func=_cmd_report)
    c = sub.add_parser("claims", help="regenerate the claims table of papers/README.md (markdown, CSV, JSON, LaTeX)")
    c.add_argument("--out", default="kvqref-report", help="output folder (default: ./kvqref-report)")
    c.add_argument("--quick", action="store_true", help="a reduced sample")
    c.set_defaults(func=_cmd_claims)
    e = sub.add_parser("eval", help="a decoder LLM (SmolLM2-135M) reading each quantized cache: perplexity, KL, top-1 "
                                    "and greedy agreement with the unquantized model, passkey retrieval")
    e.add_argument("--text", metavar="FILE", help="UTF-8 text to score (default: Python's language reference, "
                                                  "pydoc_data.topics, which ships with Python)")
    e.add_argument("--tokens", type=int, help="teacher-forced positions scored (default 2048; --quick 128)")
    e.add_argument("--schemes", metavar="LIST", help="comma-separated configuration labels or scheme names "
                                                     "(default: every configuration; see docs/eval.md)")
    e.add_argument("--json", metavar="OUT", help="write the rows and settings as JSON")
    e.add_argument("--markdown", metavar="OUT", help="write the tables as markdown")
    e.add_argument("--quick", action="store_true", help="a few configurations on short sequences (seconds)")
    e.add_argument("--prompts", type=int, help="greedy-generation prompts (default: all 8; 0: none)")
    e.add_argument("--gen-tokens", type=int, help="tokens generated per prompt (default 32)")
    e.add_argument("--passkey-tokens", type=int, help="passkey prompt length in tokens (default 4096)")
    e.add_argument("--depths", metavar="LIST", help="passkey depths in [0, 1], comma-separated (default "
                                                    "0.1,0.3,0.5,0.7,0.9; empty: no passkey test)")
    e.add_argument("--no-builtin", action="store_true",
                   help="skip the side-by-side run of transformers' own QuantizedCache backends")
    e.add_argument("--threads", type=int, help="torch threads (default: the cores not busy with other work)")
    e.add_argument("--rotation", choices=("none", "hadamard", "both"), default="none",
                   help="Hadamard-rotated K/V (docs/rotation.md): 'hadamard' rotates every configuration, 'both' "
                        "runs each without and with rotation and adds the with/without table (markdown, CSV, "
                        "JSON, LaTeX beside --markdown) and its plot (default configurations with a rotation: "
                        "one per format and granularity, see docs/eval.md)")
    e.add_argument("--scales", action="store_true",
                   help="instead: what each choice of FP8 K/V scale (1.0, vLLM first batch, frozen first prefill, "
                        "calibrated static, per token) costs in perplexity/KL/top-1 and saturation; with --markdown "
                        "OUT, --text, --tokens (evaluation tokens, default 1024), --threads (kvqref/eval/scales.py)")
    e.set_defaults(func=_cmd_eval)
    k = sub.add_parser("check", help="conformance of a backend against the oracle (bytes written, attention)")
    k.add_argument("--backend", required=True, help="numpy, torch or triton (triton without a GPU: "
                                                    "TRITON_INTERPRET=1)")
    k.add_argument("--full", action="store_true", help="larger caches (slow in the Triton interpreter)")
    k.set_defaults(func=_cmd_check)
    cp = sub.add_parser("capacity", help="tokens of KV cache that fit in a memory budget, per scheme")
    cp.add_argument("--memory", default="80GiB", help="e.g. 80GiB, 141GB, 512MiB (default 80GiB)")
    cp.add_argument("--layers", type=int, default=32)
    cp.add_argument("--kv-heads", type=int, default=8)
    cp.add_argument("--head-dim", type=int, default=128)
    cp.add_argument("--num-seqs", type=int, default=1, help="sequences (KIVI reserves a residual window each)")
    cp.add_argument("--schemes", help="comma-separated scheme names (default: a standard set)")
    cp.set_defaults(func=_cmd_capacity)
    sub.add_parser("formats", help="table of every element format").set_defaults(func=_cmd_formats)
    add_calibrate_parser(sub)
    v = sub.add_parser("vectors", help="export the golden test vectors (JSON)")
    v.add_argument("--out", required=True, help="output folder")
    v.set_defaults(func=_cmd_vectors)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.func(args))
    except UsageError as e:
        print(f"kvqref {args.command}: error: {e}", file=sys.stderr)
        return 2
    except CalibrationError as e:
        print(f"kvqref {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
