"""Head-major (HND) device-cache fields: each head's rows of a page contiguous, the same bytes per (token, head)
as the paged cache's token-major (NHD) pages. Decode reads them to the same bits, writes put the oracle's bytes
there (``codecs.page_slot``: the one rule that maps a page and a token to a field row)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from test_triton import BIG, DEVICE, GPU, IDS, PAIRS, SMALL, WRITE_CASES, WRITE_IDS, _oracle, build_cache  # noqa: E402

from kvqref.backends import triton_backend as tb  # noqa: E402
from kvqref.conformance import kv_tensor, triton_write_matches  # noqa: E402
from kvqref.kernels.decode import CacheTiles  # noqa: E402

pytestmark = pytest.mark.gpu if GPU else pytest.mark.interpret

# the interpreter runs one pair per tile path (FP8 rows, FP4 block rows, KIVI key rows with residual, NVFP4);
# the GPU runs every pair
DECODE_PAIRS = list(range(len(PAIRS))) if GPU else [1, 6, 7, 9]


@pytest.mark.parametrize("index", DECODE_PAIRS, ids=[IDS[i] for i in DECODE_PAIRS])
def test_head_major_decode_equals_token_major(index):
    rng = np.random.default_rng(100 + index)
    shape = BIG if GPU else SMALL
    cache, _ = build_cache(PAIRS[index], shape, rng)
    q = torch.from_numpy(rng.standard_normal((shape["batch"], shape["q_heads"], shape["head_dim"]))
                         .astype(np.float32)).to(torch.bfloat16)
    nhd = tb.DeviceCache.from_cache(cache, DEVICE)
    hnd = tb.DeviceCache.from_cache(cache, DEVICE, layout="HND")
    assert (nhd.layout, hnd.layout) == ("NHD", "HND") and nhd.num_pages == hnd.num_pages == cache.num_pages
    first = next(iter(hnd.k.fields))
    assert hnd.k.fields[first].shape[:3] == (cache.num_pages, shape["kv_heads"], shape["page_size"])
    qd = q.to(DEVICE)
    out_n, lse_n = tb.decode(qd, nhd)
    out_h, lse_h = tb.decode(qd, hnd)
    # the same arithmetic on the same bytes: equal bits
    assert torch.equal(out_n, out_h) and torch.equal(lse_n, lse_h)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q.float().numpy().astype(np.float64))
    assert (np.abs(out_h.cpu().numpy() - ref_out) <= tol_o).all()
    assert (np.abs(lse_h.cpu().numpy() - ref_lse) <= tol_l).all()


@pytest.mark.parametrize("name,opts", WRITE_CASES, ids=WRITE_IDS)
def test_head_major_write_bytes_equal_oracle(name, opts):
    rng = np.random.default_rng(7)
    x = kv_tensor(rng, 256 if GPU else 64, 2, 64, outliers=True)
    x[3, 0] = 0.0
    x[9, 1, 4] = 1e-30
    ok, detail = triton_write_matches(name, opts, x, max(16, opts.get("group_size", 1)), rng, layout="HND")
    assert ok, f"{name} {opts}: {detail}"


def test_layouts_convert_both_ways_and_bad_layouts_are_refused():
    rng = np.random.default_rng(3)
    cache, _ = build_cache(PAIRS[7], SMALL, rng)  # KIVI: per-token and per-group fields, residual windows
    nhd = tb.DeviceCache.from_cache(cache, DEVICE)
    hnd = nhd.with_layout("HND")
    assert nhd.with_layout("NHD") is nhd and hnd.layout == "HND"
    back = hnd.with_layout("NHD")
    for a, b, c in ((nhd.k, hnd.k, back.k), (nhd.v, hnd.v, back.v)):
        for f in a.fields:
            assert torch.equal(a.fields[f], c.fields[f]) and torch.equal(a.fields[f], b.slot_rows(f)), f
    with pytest.raises(ValueError, match="layout must be one of"):
        tb.DeviceCache.from_cache(cache, DEVICE, layout="hnd")
    with pytest.raises(ValueError, match="layout must be one of"):
        nhd.with_layout("NDH")
    q = torch.zeros(3, 4, 64, device=DEVICE, dtype=torch.bfloat16)
    mixed = tb.DeviceCache(hnd.k, nhd.v, nhd.page_size, nhd.block_table, nhd.seq_lens, nhd.k_lens, nhd.v_lens,
                           nhd.k_residual, nhd.v_residual, nhd.has_residual)
    with pytest.raises(ValueError, match="one layout"):
        tb.decode(q, mixed)
    with pytest.raises(ValueError, match="one layout"):
        tb.decode(q, mixed, validate=False)  # plan_decode checks it too
    f = hnd.k.fields["codes"]
    bad = f.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, pages not outermost
    with pytest.raises(ValueError, match="page stride"):
        CacheTiles("int_k", [bad], hnd.k.tensor_scale, head_major=True, group=16, bits=4)
    hnd.block_table[1, 0] = hnd.num_pages  # one past the last page
    with pytest.raises(ValueError, match="page indices"):
        tb.decode(q, hnd)


ROTATED_WRITE_CASES = [WRITE_CASES[i] for i in (1, 9, 12, 13, 15)]  # fp8, fp4_e2m1, nvfp4, KIVI values and keys


@pytest.mark.parametrize("name,opts", ROTATED_WRITE_CASES, ids=[f"{n}-{'-'.join(map(str, o.values()))}"
                                                                for n, o in ROTATED_WRITE_CASES])
def test_head_major_rotated_write_bytes_equal_oracle(name, opts):
    """Rotated writes (the butterflies before the quantization, their default route) into head-major fields."""
    rng = np.random.default_rng(8)
    x = kv_tensor(rng, 256 if GPU else 64, 2, 64, outliers=True)
    rotated = {**opts, "rotation": "hadamard", "rotation_seed": 3}
    ok, detail = triton_write_matches(name, rotated, x, max(16, opts.get("group_size", 1)), rng, layout="HND")
    assert ok, f"{name} {rotated}: {detail}"


def test_torch_backend_reads_head_major_fields():
    """The unfused torch backend over a triton device cache reads the fields slot by slot in either layout."""
    from kvqref.backends import torch_backend

    rng = np.random.default_rng(12)
    for index in (6, 7):  # FP4 block scales; KIVI per-group key fields and residual windows
        cache, _ = build_cache(PAIRS[index], SMALL, rng)
        q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32)).to(DEVICE)
        nhd = tb.DeviceCache.from_cache(cache, DEVICE)
        out_n, _ = torch_backend.decode(q, nhd, precision="exact")
        out_h, _ = torch_backend.decode(q, nhd.with_layout("HND"), precision="exact")
        assert torch.equal(out_n, out_h), IDS[index]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_write_refuses_slots_outside_the_cache(layout):
    rng = np.random.default_rng(13)
    cache, _ = build_cache(PAIRS[1], SMALL, rng)
    side = tb.DeviceCache.from_cache(cache, DEVICE, layout=layout).k
    assert side.num_slots == cache.num_pages * SMALL["page_size"]
    x = torch.zeros(2, SMALL["kv_heads"], SMALL["head_dim"], device=DEVICE)
    for bad in ([0, side.num_slots], [-2, 0]):
        with pytest.raises(ValueError, match="outside"):
            tb.quantize_write(side, x, torch.tensor(bad, device=DEVICE))
    tb.quantize_write(side, x, torch.tensor([-1, side.num_slots - 1], device=DEVICE))  # -1 skips; the last slot
