"""Which default decode launches changed between two versions of kernels/decode.py, by their sm_90 SASS.

    git show <commit>:kvqref/kernels/decode.py > /tmp/base_decode.py
    python3 bench/sass_defaults.py --base /tmp/base_decode.py [--out diff.json] [--no-pdl]

Plans every scheme's default decode launches (``plan_decode`` with no launch options) with each module as on an H200
(``_nvidia_cuda`` true, the device named "NVIDIA H200", 132 multiprocessors, the FP8 formats sm_90 converts in
hardware; the merge a programmatic dependent launch where the module has ``pdl_supported``, as on sm_90: ``--no-pdl``
plans without it, to compare with a module from before it), for 4 query heads per KV head head-major and
token-major, 8 and 1 head-major (2 KV heads, head_dim 128, 140 tokens of random K/V in pages of 16, KIVI pages of 32
without a residual window), compiles each launch for sm_90
as ``python3 -m kvqref.kernels.aot`` does and prints, per case, every launch's kernel, the md5 of its SASS
instruction text (addresses dropped), registers, shared memory and warps / stages / register cap, marking the cases
whose launches differ. A change meant for one launch that alters another shows here before any GPU run (session 30:
NVFP4 per element at 8 query heads per KV head had grown from 42 to 58 KB of shared memory). Needs a process without
TRITON_INTERPRET; about five minutes on two cores with a cold Triton cache.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import re
import sys
import warnings
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMES = ("bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "mxfp4", "nvfp4", "int4_kivi", "int2_kivi")
#: (query heads per KV head, the cache's field layout)
CASES = ((4, "HND"), (8, "HND"), (4, "NHD"), (1, "HND"))


def load_decode(name: str, pdl: bool = True) -> ModuleType:
    """A decode module by file path (``*.py``) or module name, patched to plan as on an H200 (``pdl``: with the merge
    as a programmatic dependent launch where the module has it, as there)."""
    if name.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"decode_{abs(hash(name))}", name)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(name)
    mod._nvidia_cuda = lambda t: True
    mod._device_name = lambda d: "NVIDIA H200"
    mod._multiprocessors = lambda d: 132
    if hasattr(mod, "pdl_supported"):  # (sm_90: the merge as a programmatic dependent launch, session 31)
        mod.pdl_supported = lambda t: pdl
    return mod


def launch_facts(mod: ModuleType, scheme: str, qpk: int, layout: str) -> list[str]:
    """``kernel:md5:registers:shared:warps/stages/cap`` of each default launch of ``scheme`` (an error's text if
    planning or compiling fails)."""
    import numpy as np
    import torch
    from sass_mix import sass_of

    from kvqref import schemes
    from kvqref.backends import triton_backend as tb
    from kvqref.kernels.aot import _hw_formats
    from kvqref.paged import PagedKVCache

    kivi = "kivi" in scheme
    ko = {"role": "key", "residual": 0} if kivi else {}
    vo = {"role": "value", "residual": 0} if kivi else {}
    page = 32 if kivi else 16
    rng = np.random.default_rng(0)
    cache = PagedKVCache(schemes.get(scheme, **ko), schemes.get(scheme, **vo), 24, page, 2, 128, batch=2)
    for b in range(2):
        cache.append(b, rng.standard_normal((140, 2, 128)), rng.standard_normal((140, 2, 128)))
    dc = tb.DeviceCache.from_cache(cache, "cpu").with_layout(layout)
    q = torch.zeros(2, 2 * qpk, 128, dtype=torch.bfloat16)
    residual = dc.residual
    try:
        launches, _, _ = mod.plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                         residual=residual, max_seq_len=140, hw_formats=_hw_formats("cuda:90"))
        facts = []
        for launch in launches:
            sass, regs, smem = sass_of(launch)
            text = "\n".join(re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in sass.splitlines()
                             if re.search(r"/\*[0-9a-f]{4}\*/", line))
            name = getattr(getattr(launch.kernel, "fn", launch.kernel), "__name__", "?")
            opts = launch.options
            facts.append(f"{name}:{hashlib.md5(text.encode()).hexdigest()[:10]}:r{regs}:s{smem}:"
                         f"{opts.get('num_warps')}/{opts.get('num_stages')}/{opts.get('maxnreg')}")
        return facts
    except Exception as exc:  # noqa: BLE001 - reported per case
        return [f"error {type(exc).__name__}: {str(exc)[:120]}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the baseline decode module (a .py file or a module name)")
    ap.add_argument("--cur", default="kvqref.kernels.decode", help="the decode module to compare")
    ap.add_argument("--out", help="write {case: {base, cur}} here")
    ap.add_argument("--no-pdl", action="store_true", help="plan both without programmatic dependent launches")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    mods = {"base": load_decode(args.base, not args.no_pdl), "cur": load_decode(args.cur, not args.no_pdl)}
    doc, changed = {}, 0
    for scheme in SCHEMES:
        for qpk, layout in CASES:
            case = f"{scheme} {qpk} q heads per KV head {layout}"
            doc[case] = {k: launch_facts(m, scheme, qpk, layout) for k, m in mods.items()}
            same = doc[case]["base"] == doc[case]["cur"]
            changed += not same
            print(f"{'same   ' if same else 'CHANGED'} {case}: {' '.join(doc[case]['cur'])}", flush=True)
            if not same:
                print(f"        base: {' '.join(doc[case]['base'])}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"{changed} of {len(doc)} cases changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
