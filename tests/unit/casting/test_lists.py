"""The default lists equal torch.autocast's, op by op, for the installed torch."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import ampkit as amp
from ampkit.casting import engine as casting
from ampkit.casting.lists import AUTOCAST_KEYS, BANNED_OPS, CATEGORIES, DEFAULT_LISTS


@pytest.mark.fresh_process  # ampkit kernels kept by earlier tests would be counted too
@pytest.mark.parametrize("device_type", sorted(AUTOCAST_KEYS))
def test_lists_cover_exactly_the_registered_autocast_kernels(device_type):
    registered = {
        r.split("::", 1)[1].split(".", 1)[0]
        for r in torch._C._dispatch_get_registrations_for_dispatch_key(AUTOCAST_KEYS[device_type])
        if r.startswith("aten::")
    }
    ours = {n for names in DEFAULT_LISTS[device_type].values() for n in names}
    assert ours | set(BANNED_OPS[device_type]) == registered


@pytest.mark.parametrize("device_type", sorted(DEFAULT_LISTS))
def test_categories_are_disjoint_and_name_real_ops(device_type):
    seen: dict[str, str] = {}
    for category in CATEGORIES:
        for name in DEFAULT_LISTS[device_type][category]:
            assert name not in seen, f"{name} in {seen.get(name)} and {category}"
            seen[name] = category
            assert torch.ops.aten.__getattr__(name).overloads()


# --- op table: (label, fn, kind). kind picks the inputs. ------------------------
def _spd(x):
    return x @ x.mT + 4 * torch.eye(x.shape[-1], dtype=x.dtype)


OPS = [
    # lower
    ("mm", lambda t: torch.mm(t["m"], t["m"]), "m"),
    ("matmul_op", lambda t: t["m"] @ t["m"], "m"),
    ("matmul", lambda t: torch.matmul(t["b3"], t["b3"]), "m"),
    ("bmm", lambda t: torch.bmm(t["b3"], t["b3"]), "m"),
    ("addmm", lambda t: torch.addmm(t["v"], t["m"], t["m"]), "m"),
    ("baddbmm", lambda t: torch.baddbmm(t["b3"], t["b3"], t["b3"]), "m"),
    ("addbmm", lambda t: torch.addbmm(t["m"], t["b3"], t["b3"]), "m"),
    ("linear", lambda t: F.linear(t["m"], t["m"], t["v"]), "m"),
    ("conv1d", lambda t: F.conv1d(t["c1"], t["w1"]), "m"),
    ("conv2d", lambda t: F.conv2d(t["c2"], t["w2"]), "m"),
    ("conv3d", lambda t: F.conv3d(t["c3"], t["w3"]), "m"),
    ("conv_transpose1d", lambda t: F.conv_transpose1d(t["c1"], t["w1"].transpose(0, 1)), "m"),
    ("conv_transpose2d", lambda t: F.conv_transpose2d(t["c2"], t["w2"].transpose(0, 1)), "m"),
    ("conv_transpose3d", lambda t: F.conv_transpose3d(t["c3"], t["w3"].transpose(0, 1)), "m"),
    ("prelu", lambda t: F.prelu(t["c2"], t["v"][:2]), "m"),
    ("sdpa", lambda t: F.scaled_dot_product_attention(t["q"], t["q"], t["q"]), "m"),
    ("linalg_vecdot", lambda t: torch.linalg.vecdot(t["m"], t["m"]), "m"),
    ("einsum", lambda t: torch.einsum("ij,jk->ik", t["m"], t["m"]), "m"),
    # fp32
    ("avg_pool3d", lambda t: F.avg_pool3d(t["c3"], 2), "m"),
    ("max_pool3d", lambda t: F.max_pool3d(t["c3"], 2), "m"),
    ("adaptive_avg_pool3d", lambda t: F.adaptive_avg_pool3d(t["c3"], 1), "m"),
    ("adaptive_max_pool3d", lambda t: F.adaptive_max_pool3d(t["c3"], 1), "m"),
    ("binary_cross_entropy", lambda t: F.binary_cross_entropy(t["p"], t["p"]), "m"),
    ("bce_with_logits", lambda t: F.binary_cross_entropy_with_logits(t["m"], t["p"]), "m"),
    ("grid_sample", lambda t: F.grid_sample(t["c2"], t["grid"], align_corners=False), "m"),
    ("polar", lambda t: torch.polar(t["p"], t["m"]), "m"),
    ("prod", lambda t: torch.prod(t["m"]), "m"),
    ("prod_dim", lambda t: torch.prod(t["m"], 1), "m"),
    ("quantile", lambda t: torch.quantile(t["m"], 0.5), "m"),
    ("nanquantile", lambda t: torch.nanquantile(t["m"], 0.5), "m"),
    ("cdist", lambda t: torch.cdist(t["m"], t["m"]), "m"),
    ("trace", lambda t: torch.trace(t["m"]), "m"),
    ("cholesky", lambda t: torch.linalg.cholesky(_spd(t["m"])), "m"),
    ("inverse", lambda t: torch.inverse(_spd(t["m"])), "m"),
    ("linalg_inv", lambda t: torch.linalg.inv(_spd(t["m"])), "m"),
    ("pinverse", lambda t: torch.pinverse(t["m"]), "m"),
    ("linalg_solve", lambda t: torch.linalg.solve(_spd(t["m"]), t["m"]), "m"),
    ("linalg_qr", lambda t: torch.linalg.qr(t["m"]), "m"),
    ("linalg_svd", lambda t: torch.linalg.svd(t["m"]), "m"),
    ("linalg_svdvals", lambda t: torch.linalg.svdvals(t["m"]), "m"),
    ("linalg_eigh", lambda t: torch.linalg.eigh(_spd(t["m"])), "m"),
    ("linalg_eigvalsh", lambda t: torch.linalg.eigvalsh(_spd(t["m"])), "m"),
    ("linalg_matrix_rank", lambda t: torch.linalg.matrix_rank(t["m"]), "m"),
    ("reflection_pad1d", lambda t: F.pad(t["c1"], (1, 1), mode="reflect"), "m"),
    ("replication_pad2d", lambda t: F.pad(t["c2"], (1, 1, 1, 1), mode="replicate"), "m"),
    ("mse_loss", lambda t: F.mse_loss(t["m"], t["m"] * 0.5), "m"),
    ("l1_loss", lambda t: F.l1_loss(t["m"], t["m"] * 0.5), "m"),
    ("smooth_l1_loss", lambda t: F.smooth_l1_loss(t["m"], t["m"] * 0.5), "m"),
    ("huber_loss", lambda t: F.huber_loss(t["m"], t["m"] * 0.5), "m"),
    ("cross_entropy", lambda t: F.cross_entropy(t["m"], t["y"]), "m"),
    ("nll_loss", lambda t: F.nll_loss(t["m"], t["y"]), "m"),
    ("kl_div", lambda t: F.kl_div(t["m"], t["p"], reduction="batchmean"), "m"),
    ("poisson_nll_loss", lambda t: F.poisson_nll_loss(t["m"], t["p"]), "m"),
    ("soft_margin_loss", lambda t: F.soft_margin_loss(t["m"], t["m"].sign()), "m"),
    ("hinge_embedding_loss", lambda t: F.hinge_embedding_loss(t["m"], t["m"].sign()), "m"),
    ("margin_ranking_loss", lambda t: F.margin_ranking_loss(t["v"], t["v"] * 2, t["v"].sign()), "m"),
    ("cosine_embedding_loss", lambda t: F.cosine_embedding_loss(t["m"], t["m"] + 1, t["v"].sign()), "m"),
    ("triplet_margin_loss", lambda t: F.triplet_margin_loss(t["m"], t["m"] + 1, t["m"] - 1), "m"),
    ("multi_margin_loss", lambda t: F.multi_margin_loss(t["m"], t["y"]), "m"),
    ("multilabel_margin_loss", lambda t: F.multilabel_margin_loss(t["m"], t["y2"]), "m"),
    ("fft_fft", lambda t: torch.fft.fft(t["m"]), "m"),
    ("fft_rfft", lambda t: torch.fft.rfft(t["m"]), "m"),
    ("fft_ifft", lambda t: torch.fft.ifft(t["m"]), "m"),
    ("fft_rfft2", lambda t: torch.fft.rfft2(t["m"]), "m"),
    # promote
    ("cat", lambda t: torch.cat([t["m"], t["mlow"]]), "m"),
    ("stack", lambda t: torch.stack([t["m"], t["mlow"]]), "m"),
    ("index_copy", lambda t: t["m"].index_copy(0, t["idx"], t["mlow"][:2]), "m"),
    # not listed: run in the inputs' dtype
    ("relu", lambda t: torch.relu(t["m"]), "m"),
    ("gelu", lambda t: F.gelu(t["m"]), "m"),
    ("softmax", lambda t: torch.softmax(t["m"], -1), "m"),
    ("log_softmax", lambda t: F.log_softmax(t["m"], -1), "m"),
    ("exp", lambda t: torch.exp(t["m"]), "m"),
    ("sum", lambda t: t["m"].sum(), "m"),
    ("mean", lambda t: t["m"].mean(), "m"),
    ("layer_norm", lambda t: F.layer_norm(t["m"], (4,)), "m"),
    ("add_mixed", lambda t: t["m"] + t["mlow"], "m"),
    ("tanh", lambda t: torch.tanh(t["m"]), "m"),
]


def _inputs(dtype: torch.dtype, low: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "m": r(4, 4),
        "mlow": r(4, 4).to(low),
        "v": r(4),
        "b3": r(2, 4, 4),
        "c1": r(1, 2, 6),
        "w1": r(2, 2, 3),
        "c2": r(1, 2, 6, 6),
        "w2": r(2, 2, 3, 3),
        "c3": r(1, 2, 4, 4, 4),
        "w3": r(2, 2, 3, 3, 3),
        "q": r(1, 2, 4, 4),
        "p": torch.rand(4, 4, generator=g).to(dtype) * 0.8 + 0.1,
        "grid": (torch.rand(1, 3, 3, 2, generator=g) * 2 - 1).to(dtype),
        "y": torch.tensor([0, 1, 2, 3]),
        "y2": torch.tensor([[0, 1, -1, 0], [2, -1, 0, 0], [3, 2, 1, -1], [1, -1, 0, 0]]),
        "idx": torch.tensor([0, 2]),
    }


def _outcome(fn, inputs):
    try:
        out = fn(inputs)
    except Exception as e:  # the same failure is also a match
        return type(e).__name__
    leaves = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(x.dtype for x in leaves if isinstance(x, torch.Tensor))


def _mismatches(device_type, dtype, inputs, intercept_all):
    """Ops whose outcome (output dtypes, or the error raised) differs between
    torch.autocast and ampkit's default policy."""
    policy = amp.default_policy(device_type, dtype)
    out = []
    for label, fn, _ in OPS:
        with torch.autocast(device_type, dtype=dtype):
            want = _outcome(fn, inputs)
        with casting.open_scope(policy, device_type, intercept_all=intercept_all):
            got = _outcome(fn, inputs)
        if want != got:
            out.append((label, want, got))
    return out


def test_table_has_at_least_60_ops_in_every_category():
    assert len(OPS) >= 60
    names = " ".join(label for label, _, _ in OPS)
    for op in ("mm", "cross_entropy", "cat", "relu"):
        assert op in names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("input_dtype", ["fp32", "low"])
@pytest.mark.parametrize("intercept_all", [False, True], ids=["native", "ampkit-kernels"])
def test_default_policy_matches_torch_autocast_op_by_op(dtype, input_dtype, intercept_all):
    """Same output dtypes as torch.autocast, both when ampkit defers to the native
    kernels and when every listed op goes through ampkit's own kernels."""
    inputs = _inputs(torch.float32 if input_dtype == "fp32" else dtype, dtype)
    assert not _mismatches("cpu", dtype, inputs, intercept_all)


def test_ampkit_kernels_are_transparent_to_plain_torch_autocast():
    """Once ampkit registered kernels, torch.autocast outside any ampkit scope still
    behaves exactly as before."""
    inputs = _inputs(torch.float32, torch.bfloat16)
    with casting.open_scope(amp.default_policy("cpu"), "cpu", intercept_all=True):
        pass
    for label, fn, _ in OPS:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = _outcome(fn, inputs)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            again = _outcome(fn, inputs)
        assert got == again, label
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(inputs["m"], inputs["m"]).dtype == torch.bfloat16
        assert F.cross_entropy(inputs["m"].bfloat16(), inputs["y"]).dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.parametrize("intercept_all", [False, True], ids=["native", "ampkit-kernels"])
def test_default_cuda_policy_matches_torch_autocast(intercept_all):
    inputs = {k: v.cuda() for k, v in _inputs(torch.float32, torch.float16).items()}
    assert not _mismatches("cuda", torch.float16, inputs, intercept_all)


# --- tables keyed by torch release --------------------------------------------------------


def test_tables_are_keyed_by_torch_release_and_the_installed_one_is_used():
    from ampkit.casting import lists

    assert lists.torch_release("2.13.0+cpu") == (2, 13) and lists.torch_release("2.13.1") == (2, 13)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a release with a table: no warning
        assert lists.table_release("2.13.0+cu128") == (2, 13)
    assert lists.RELEASE == lists.torch_release(torch.__version__)  # the suite runs a torch with a table
    assert lists.DEFAULT_LISTS is lists.TABLES[lists.RELEASE] and lists.DROPPED_OPS == ()
    assert lists.BANNED_OPS == lists.BANNED_TABLES[lists.RELEASE]


def test_an_unknown_torch_release_uses_the_nearest_older_table_and_says_so():
    from ampkit.casting import lists

    assert sorted(lists.TABLES) == sorted(lists.RELEASES) == [(2, 9), (2, 10), (2, 11), (2, 13), (2, 15)]
    with pytest.warns(UserWarning, match=r"torch 2\.99\.0, so the 2\.15 tables are used.*generate --check"):
        assert lists.table_release("2.99.0") == (2, 15)
    with pytest.warns(UserWarning, match=r"so the 2\.13 tables are used"):
        assert lists.table_release("2.14.1") == (2, 13)
    with pytest.warns(UserWarning, match=r"so the 2\.9 tables are used"):
        assert lists.table_release("2.8.0") == (2, 9)  # older than every table: the oldest
    with pytest.raises(amp.PolicyError, match="cannot read a torch release"):
        lists.torch_release("nightly")


def test_the_release_tables_differ_as_their_torch_registers():
    """Each table was generated from its release's wheel (2.9.1+cu128, 2.10.0+cu128,
    2.11.0+cu130, 2.13.0+cpu, 2.15.0+cu132): 2.9's and 2.10's lists are 2.11's; 2.11's
    CUDA list lacks rms_norm; 2.15 removed cholesky and qr and added
    linalg_matrix_sqrth (fp32); only the CUDA wheels register cuDNN's RNN."""
    from ampkit.casting import lists

    assert lists.TABLE_SOURCES == {
        (2, 9): "2.9.1+cu128",
        (2, 10): "2.10.0+cu128",
        (2, 11): "2.11.0+cu130",
        (2, 13): "2.13.0+cpu",
        (2, 15): "2.15.0+cu132",
    }
    t9, t10, t11, t13, t15 = (lists.TABLES[r] for r in ((2, 9), (2, 10), (2, 11), (2, 13), (2, 15)))
    assert t9 == t10 == t11
    assert lists.BANNED_TABLES[(2, 9)] == lists.BANNED_TABLES[(2, 10)] == lists.BANNED_TABLES[(2, 11)]
    assert t11["cpu"] == t13["cpu"]
    assert "rms_norm" in t13["cuda"]["fp32"] and "rms_norm" not in t11["cuda"]["fp32"]
    assert {"cholesky", "qr"} <= set(t13["cpu"]["fp32"]) and not {"cholesky", "qr"} & set(t15["cpu"]["fp32"])
    assert "linalg_matrix_sqrth" in t15["cpu"]["fp32"] and "linalg_matrix_sqrth" in t15["cuda"]["fp32"]
    assert "_cudnn_rnn" in t11["cuda"]["lower"] and "_cudnn_rnn" in t15["cuda"]["lower"]
    assert ("_cudnn_rnn" in t13["cuda"]["lower"]) == torch.backends.cudnn.is_available()  # added where it exists
    for device in ("cpu", "cuda"):
        assert t11[device]["promote"] == t13[device]["promote"] == t15[device]["promote"]
        assert set(t11[device]["lower"]) - {"_cudnn_rnn"} == set(t13[device]["lower"]) - {"_cudnn_rnn"}


@pytest.mark.fresh_process  # ampkit's own autocast kernels would be probed too
def test_the_table_in_use_is_what_this_torch_derives(capsys):
    """``generate --check`` derives the categories from the running torch's autocast
    kernels and finds no difference from the checked-in table of this release; the module
    the generator would write is the checked-in one, byte for byte (but for the torch
    build it names)."""
    from ampkit.casting import lists
    from ampkit.casting.lists import derive, generate

    assert generate.main(["--check"]) == 0
    assert "no difference" in capsys.readouterr().out
    derived = derive.derive()
    assert not any(derived.unplaced.values()) and not any(derived.conflicts.values())
    path = generate.TABLES_DIR / generate.file_name(lists.RELEASE)
    written = generate.render(derived, lists.RELEASE).replace(torch.__version__, lists.TABLE_SOURCES[lists.RELEASE])
    if not torch.backends.cudnn.is_available() or "_cudnn_rnn" in path.read_text():
        assert written == path.read_text()
    # against another release's table it names what differs (2.10's and 2.11's CUDA lists
    # lack rms_norm)
    other = (2, 13) if lists.RELEASE <= (2, 11) else (2, 11)
    lines = generate.differences(lists.TABLES[other], lists.BANNED_TABLES[other], derived)
    assert any(line.startswith("cuda: rms_norm: table ") for line in lines), lines


@pytest.mark.fresh_process
def test_the_probe_reads_a_kernel_it_has_never_seen():
    """A planted autocast kernel for ``aten::tanh`` (no autocast kernel in torch) that
    casts its input to fp32 is derived as ``fp32``, and ``--check`` reports it; after the
    kernel is gone, tanh is absent again."""
    from ampkit._internal import torch_compat as tc
    from ampkit.casting import lists
    from ampkit.casting.lists import derive, generate

    def fp32_tanh(x):
        with tc.exclude_dispatch_keys(tc.autocast_keyset()):
            return torch.ops.aten.tanh.default(x.float())

    def lower_tanh(x):
        with tc.exclude_dispatch_keys(tc.autocast_keyset()):
            return torch.ops.aten.tanh.default(x.to(torch.get_autocast_dtype("cpu")))

    for kernel, category in ((fp32_tanh, "fp32"), (lower_tanh, "lower")):
        lib = torch.library.Library("aten", "IMPL")
        try:
            lib.impl("tanh", kernel, "AutocastCPU")
            derived = derive.derive(("cpu",))
            assert "tanh" in derived.lists["cpu"][category]
            lines = generate.differences(lists.DEFAULT_LISTS, lists.BANNED_OPS, derived)
            assert lines == [f"cpu: tanh: table absent, this torch {category}"]
            with torch.autocast("cpu", dtype=torch.bfloat16):  # what the probe read is what autocast does
                out = torch.tanh(torch.ones(2, dtype=torch.bfloat16 if category == "fp32" else torch.float32))
            assert out.dtype == (torch.float32 if category == "fp32" else torch.bfloat16)
        finally:
            tc.destroy_library(lib)
    assert "tanh" not in {n for names in derive.derive(("cpu",)).lists["cpu"].values() for n in names}


def test_generated_files_hold_sorted_disjoint_lists():
    """The checked-in tables are the generator's output: sorted names, no name twice
    within a device type, the three categories and the banned list for both."""
    import json

    from ampkit.casting import lists
    from ampkit.casting.lists import generate

    for release in lists.RELEASES:
        data = json.loads((generate.TABLES_DIR / generate.file_name(release)).read_text())
        assert data["release"] == f"{release[0]}.{release[1]}" and data["torch"].startswith(data["release"] + ".")
        for device in ("cpu", "cuda"):
            assert tuple(data[device]) == ("lower", "fp32", "promote")
            names = [n for c in data[device].values() for n in c] + data["banned"][device]
            assert len(names) == len(set(names)) and all(c == sorted(c) for c in data[device].values())
            for name in data["by_hand"].get(device, []):
                assert name in derive_placed(device)


def derive_placed(device):
    from ampkit.casting.lists.derive import PLACED_BY_HAND

    return PLACED_BY_HAND.get(device, {})


def test_ops_a_newer_torch_removed_are_left_out_of_the_tables_it_borrows():
    """torch 2.15 removed aten::cholesky, which the 2.13 CPU table lists: under 2.15 the
    borrowed table leaves it out (said at import) instead of default_policy() raising
    PolicyError. Stood in for here by a torch that lacks it."""
    from ampkit.casting import lists

    table = lists.TABLES[(2, 13)]
    assert "cholesky" in table["cpu"]["fp32"]
    kept, dropped = lists.without_missing_ops(table, has_op=lambda n: n != "cholesky" and lists.aten_has(n))
    really_missing = {n for t in table.values() for names in t.values() for n in names if not lists.aten_has(n)}
    assert set(dropped) == {"cholesky"} | really_missing  # under torch 2.15 also qr
    assert "cholesky" not in kept["cpu"]["fp32"]
    for device in table:
        for category, names in table[device].items():
            assert kept[device][category] == tuple(n for n in names if n not in dropped)
    policy = amp.Policy(lower_ops=kept["cpu"]["lower"], fp32_ops=kept["cpu"]["fp32"], promote_ops=kept["cpu"]["promote"])
    assert policy.categories()["mm"] == "lower" and "cholesky" not in policy.categories()
    assert not lists.aten_has("no_such_op_anywhere") and lists.aten_has("mm")
