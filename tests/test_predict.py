"""moe-trace predict (analysis/predict.py): the counts, the numbers of hand-built traces, the
command's files and errors, the trace cache's look-ahead arrays, and captured look-ahead."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from predict_cases import lookahead_trace, random_lookahead_trace, twin_steps

from analysis.predict import HITS, NEW, PREDICTED, STEPS, score_trace
from simulator.policies.predictor import REGISTRY
from simulator.trace_cache import cached_source
from traces.cli import main
from traces.errors import EXIT_INPUT_ERROR
from traces.format import PHASE_DECODE, open_trace, write_trace

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_MODEL = ROOT / "traces" / "fixtures" / "model"
FIXTURE_TRACE = ROOT / "traces" / "samples" / "fixture.parquet"


class SmallChunks:
    """A source served in chunks of ``size`` tokens (whole groups), to cross chunk boundaries."""

    def __init__(self, source, size: int):
        self.source, self.size = source, size
        self.meta, self.num_tokens = source.meta, source.num_tokens

    def iter_chunks(self, max_tokens=None, **options):
        return self.source.iter_chunks(self.size, **options)


def twin_counts(source, name, distances, top_ps, train_tokens, options=None) -> np.ndarray:
    """int64[nd, np, L, 4]: the scoring counts computed from the reference twin's predictions."""
    chunk = source.chunk
    L = source.meta.num_layers
    E = source.meta.num_experts
    counts = np.zeros((len(distances), len(top_ps), L, 4), np.int64)
    for a, layer, d, p, _, twin in twin_steps(source, name, distances, top_ps, train_tokens,
                                              options):
        target = layer + d
        row = counts[distances.index(d), top_ps.index(p), target]
        selected = set(chunk.experts[a, target].tolist())
        before = set(chunk.experts[a - 1, target].tolist()) if a else set()
        ids = [x - target * E for x in twin]
        row[STEPS] += 1
        row[PREDICTED] += len(ids)
        row[HITS] += len(selected.intersection(ids))
        row[NEW] += len(set(ids) - before)
    return counts


@pytest.mark.parametrize("seed", range(6))
def test_the_scoring_kernel_counts_what_the_reference_twins_predict(seed):
    rng = np.random.default_rng(seed)
    source = random_lookahead_trace(rng, tokens=70)
    L, k = source.meta.num_layers, source.meta.top_k
    distances, top_ps = list(range(1, L)), sorted({1, k, k + 2})
    top_ps = [p for p in top_ps if p <= source.meta.num_experts]
    train = 4 * seed  # 0: nothing trains coactivation
    scores = score_trace(SmallChunks(source, int(rng.integers(1, 20))), distances=distances,
                         top_ps=top_ps, train_tokens=train)
    assert scores.scored_tokens == int(np.sum(source.chunk.phase[train:] == PHASE_DECODE))
    depth = source.meta.lookahead_depth  # >= 1: every predictor is scored
    names = [n for n in REGISTRY if n != "none"]
    assert [(s.predictor, s.distance, s.top_p) for s in scores.scores] == [
        (n, d, p) for n in names for d in distances if n != "lookahead" or d <= depth for p in top_ps]
    for name in names:
        mine = [s for s in scores.scores if s.predictor == name]
        ds = list(dict.fromkeys(s.distance for s in mine))
        expected = twin_counts(source, name, ds, top_ps, train)
        got = np.stack([np.stack([s.counts for s in mine if s.distance == d]) for d in ds])
        np.testing.assert_array_equal(got, expected, err_msg=name)


def test_a_trace_that_repeats_itself_is_predicted_exactly():
    # every token selects experts 1 and 2 at both layers; layer 1's experts are 300 bytes
    source = lookahead_trace(np.tile([[1, 2]], (10, 2, 1)), num_experts=4, expert_bytes=[100, 300])
    scores = score_trace(source, distances=[1], top_ps=[2, 3], train_tokens=2)
    assert scores.scored_tokens == 8
    table = {(s.predictor, s.top_p): s for s in scores.scores}
    assert set(table) == {(n, p) for n in ("previous", "frequency", "coactivation") for p in (2, 3)}
    for s in table.values():  # at P = 3 each names the 2 experts ever selected, no third
        assert s.recall(2)[-1] == 1.0 and s.precision()[-1] == 1.0
        assert np.isnan(s.recall(2)[0])  # layer 0 is never predicted
        assert scores.bytes_per_token(s, PREDICTED)[-1] == 2 * 300
    assert scores.bytes_per_token(table["previous", 2], NEW)[-1] == 0.0
    assert scores.notes == ["lookahead is skipped at distance 1: the trace has no look-ahead "
                            "routing (moe-capture lookahead.enabled=true records it)"]


def test_recall_and_precision_of_a_half_right_prediction():
    # layer 1 alternates {0, 1} and {2, 3}: the previous token is always wrong, the most
    # frequent pair half right
    layer1 = [[0, 1], [2, 3]] * 6
    source = lookahead_trace([[[0, 1], e] for e in layer1], num_experts=4)
    scores = score_trace(source, predictors=["previous", "frequency"], distances=[1],
                         top_ps=[2, 4], train_tokens=4)
    recall = {(s.predictor, s.top_p): s.recall(2)[-1] for s in scores.scores}
    precision = {(s.predictor, s.top_p): s.precision()[-1] for s in scores.scores}
    assert recall["previous", 2] == 0.0 and recall["frequency", 4] == 1.0
    assert precision["frequency", 4] == 0.5  # all four named, two selected
    # frequency at P = 2 names the two lowest ids while counts tie (after {2, 3} tokens), the
    # pair last selected otherwise; scored tokens alternate, so half its picks are right
    assert recall["frequency", 2] == 0.5


@pytest.fixture
def trace_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_SIM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    source = random_lookahead_trace(np.random.default_rng(3), tokens=80)
    path = tmp_path / "la.parquet"
    write_trace(path, source.meta, source.chunk)
    return path, source


def test_predict_command_prints_the_table_and_writes_its_files(trace_file, capsys):
    path, source = trace_file
    assert main(["predict", str(path), "--distance", "1", "--train-tokens", "10"]) == 0
    out = capsys.readouterr().out
    k = source.meta.top_k
    assert out.startswith("# Predictors: la.parquet:") and f"| predictor | distance | P | recall@{k} |" in out
    written = Path("runs") / "predict" / "la"
    assert sorted(p.name for p in written.iterdir()) == ["predict.json", "predict.md", "predict.png"]
    assert (written / "predict.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Per predicted layer" in (written / "predict.md").read_text()
    data = json.loads((written / "predict.json").read_text())
    expected = score_trace(source, distances=[1], train_tokens=10)
    assert [(r["predictor"], r["distance"], r["top_p"]) for r in data["scores"]] == [
        (s.predictor, s.distance, s.top_p) for s in expected.scores]
    for row, s in zip(data["scores"], expected.scores, strict=True):
        assert row["recall"] == s.recall(k)[-1] and row["precision"] == s.precision()[-1]
        assert f"| {s.predictor} | 1 | {k} | {100 * s.recall(k)[-1]:.1f} % |" in out


@pytest.mark.parametrize(("args", "words"), [
    (["--distance", "0"], "predict --distance 0 is outside 1 .. L - 1"),
    (["--top-p", "0"], "predict --top-p 0 is outside 1 .. E"),
    (["--train-tokens", "10000"], "predict --train-tokens 10000 leaves no token to score"),
    (["--predictor", "oracle"], "predict --predictor oracle is not known; choose from: none, "),
    (["--predictor", "lookahead", "--distance", "9"], "predict --distance 9 is outside"),
])
def test_bad_options_stop_with_one_line_and_write_nothing(trace_file, capsys, args, words):
    path, _ = trace_file
    assert main(["predict", str(path), "--out", "out", *args]) == EXIT_INPUT_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moe-trace: error: ") and words in err[0], err
    assert not Path("out").exists()


def test_lookahead_asked_for_beyond_the_trace_depth_is_an_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOE_SIM_CACHE", str(tmp_path / "cache"))
    source = lookahead_trace(np.tile([[1, 2]], (10, 3, 1)), num_experts=4)  # no look-ahead
    path = tmp_path / "plain.parquet"
    write_trace(path, source.meta, source.chunk)
    code = main(["predict", str(path), "--predictor", "lookahead", "previous", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_INPUT_ERROR and "\n" not in err and not (tmp_path / "o").exists()
    assert "predict --predictor lookahead needs look-ahead routing to distance 1, but the trace " \
           "has no look-ahead routing; capture with moe-capture lookahead.enabled=true" in err
    assert main(["predict", str(path), "--out", str(tmp_path / "o")]) == 0  # by default: a note
    assert "Note: lookahead is skipped at distance 1" in capsys.readouterr().out


@pytest.mark.parametrize("all_experts", [False, True], ids=["top_r", "all_experts"])
def test_the_trace_cache_keeps_the_lookahead_arrays(tmp_path, all_experts):
    source = random_lookahead_trace(np.random.default_rng(5), tokens=90, all_experts=all_experts)
    path = tmp_path / "la.parquet"
    write_trace(path, source.meta, source.chunk)
    cached = cached_source(path, tmp_path / "cache")
    cached.build()
    again = cached_source(path, tmp_path / "cache")
    assert not again.built  # served from the copy
    with open_trace(path) as reader:
        for a, b in zip(again.iter_chunks(13), reader.iter_chunks(13), strict=True):
            for name in ("lookahead_ids", "lookahead_logits"):
                u, v = getattr(a, name), getattr(b, name)
                assert u.dtype == v.dtype and u.shape == v.shape, name
                np.testing.assert_array_equal(u, v, err_msg=name)
    assert (score_trace(again, train_tokens=5).scores[0].counts
            == score_trace(source, train_tokens=5).scores[0].counts).all()


def _capture(model, sites, windows, path, depth, logits="full"):
    """Capture ``windows`` with look-ahead routing into one trace file."""
    from traces.capture.capture import build_meta, capture_windows
    from traces.capture.config import CaptureConfig, LookaheadConfig
    from traces.format import TraceWriter

    cfg = CaptureConfig(batch_size=4, lookahead=LookaheadConfig(enabled=True, depth=depth, logits=logits))
    meta = build_meta(model, sites, "capture", ["a", "b"], cfg, {})
    with TraceWriter(path, meta) as writer:
        capture_windows(model, sites, windows, cfg, lambda rows: writer.write(**rows.columns()))


def lookahead_recall(path, d: int, train: int) -> float:
    """Recall@k of the stored look-ahead top-k, computed from the trace directly."""
    with open_trace(path) as reader:
        chunk = reader.read_all()
    k, L = reader.meta.top_k, reader.meta.num_layers
    rows = np.flatnonzero(chunk.phase[train:] == PHASE_DECODE) + train
    hits = sum(len(set(chunk.lookahead_ids[t, layer, d - 1, :k]) & set(chunk.experts[t, layer + d]))
               for t in rows for layer in range(L - d))
    return hits / (k * len(rows) * (L - d))


def test_captured_lookahead_of_a_tiny_model_scores_as_computed_from_the_trace(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_capture import COMMON, TINY, windows

    from traces.capture.routers import find_routers

    torch.manual_seed(0)  # a random qwen3_moe of 3 MoE layers (layer 0 is dense), 8 experts, top-2
    config = transformers.AutoConfig.for_model("qwen3_moe", **{**COMMON, **TINY["qwen3_moe"],
                                                               "num_hidden_layers": 4})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path / "tiny.parquet"
    _capture(model, find_routers(model), windows([40, 33, 27]), path, depth=2)
    scores = score_trace(cached_source(path, tmp_path / "cache"), predictors=["lookahead"],
                         distances=[1, 2], top_ps=[2, 8], train_tokens=10)
    recall = {(s.distance, s.top_p): s.recall(2)[-1] for s in scores.scores}
    for d in (1, 2):
        assert recall[d, 2] == pytest.approx(lookahead_recall(path, d, 10), abs=1e-12)
        assert recall[d, 8] == 1.0  # all E experts named


@pytest.mark.skipif(not (FIXTURE_MODEL / "model.safetensors").exists(), reason="fixture model not built")
def test_lookahead_beats_the_previous_token_on_the_trained_fixture(tmp_path):
    """The stale gate on the trained fixture (6 x 64, top-4) names the next layer's experts far
    better than the previous token does: measured 77.9 % against 29.5 % recall@4 on 4,000
    tokens (docs/PREDICT.md); here 2 windows of 256 tokens of the bundled trace's text."""
    pytest.importorskip("transformers")
    from traces.capture.config import ModelConfig
    from traces.capture.model import load_model
    from traces.capture.text import Window

    model, _, sites, _ = load_model(ModelConfig(path=str(FIXTURE_MODEL), device="cpu"))
    with open_trace(FIXTURE_TRACE) as reader:
        chunk = next(reader.iter_chunks(1024, logits=False))
    windows = [Window(i, 0, chunk.token_id[chunk.seq == s][:256].astype(np.int64), "fixture")
               for i, s in enumerate(np.unique(chunk.seq)[:2])]
    path = tmp_path / "fixture_lookahead.parquet"
    _capture(model, sites, windows, path, depth=1, logits="top:8")
    scores = score_trace(cached_source(path, tmp_path / "cache"), distances=[1], train_tokens=128)
    recall = {s.predictor: s.recall(4)[-1] for s in scores.scores}
    assert recall["lookahead"] > recall["previous"] + 0.3, recall
    assert recall["lookahead"] > max(recall["frequency"], recall["coactivation"]), recall
