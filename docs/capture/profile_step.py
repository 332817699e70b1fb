"""Where a batch-16 capture's time goes on a GPU host: one forward of 16 windows of 512 tokens
through the randomly initialised Qwen3-30B-A3B shape, timed part by part (medians of 5, CUDA
synchronised): the forward, the forward with the routers hooked, the stored parts, the NLL as
committed before 2026-12-02 14:00 (``old_nll``: log-softmax of a float32 copy) and now, one
256-token unit's encoding, and the writer's tail after one forward's 8,192 tokens.

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/profile_step.py`` (writes
DIR/devprof.json). Results: docs/capture/profile_1202*.json (docs/CAPTURE.md).
"""
import hashlib, json, os, statistics, subprocess, sys, tempfile, time
from pathlib import Path
import numpy as np, torch
import torch.nn.functional as F
from traces.capture.config import CaptureConfig, ModelConfig
from traces.capture.model import load_model
from traces.capture.text import make_windows, read_documents
from traces.capture import capture as C
from traces.capture.hooks import RouterRecorder
from traces.capture.writer import ParallelTraceWriter, _write_unit
import traces.capture.writer as W

out = Path(os.environ.get("OUT", "/tmp/devprof")); out.mkdir(parents=True, exist_ok=True)
res = {}
def sync():
    if torch.cuda.is_available(): torch.cuda.synchronize()
def timeit(fn, n=5):
    fn(); sync(); ts = []
    for _ in range(n):
        sync(); t = time.perf_counter(); fn(); sync(); ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1e3, 2)

def old_nll(lm_logits, input_ids):
    B, S, V = lm_logits.shape
    nll = torch.full((B, S), float("nan"), dtype=torch.float32, device=lm_logits.device)
    rows = max(1, (1 << 28) // max(1, S * V))
    for b in range(0, B, rows):
        lg = lm_logits[b: b + rows, :-1].float()
        nll[b: b + rows, 1:] = F.cross_entropy(lg.reshape(-1, V), input_ids[b: b + rows, 1:].reshape(-1),
                                              reduction="none").view(lg.shape[0], S - 1)
    return nll

res["cpu"] = subprocess.run("lscpu | grep -E 'Model name|^CPU\\(s\\)|Thread|sha_ni' | cut -c1-120", shell=True,
                            capture_output=True, text=True).stdout
res["sha_ni"] = "sha_ni" in open("/proc/cpuinfo").read()
buf = os.urandom(64 << 20); t = time.perf_counter(); hashlib.sha256(buf).digest()
res["sha256_MBps"] = round(64 / (time.perf_counter() - t))
t0 = time.perf_counter()
model, tok, sites, name = load_model(ModelConfig(config=os.environ.get("SHAPE", "traces/fixtures/shapes/qwen3_30b_a3b.json"),
                                                tokenizer="traces/fixtures/model", device="auto"))
res["load_s"] = round(time.perf_counter() - t0, 1)
docs = read_documents(["docs", "README.md", "traces", "simulator", "analysis"])
windows, domains = make_windows(docs, tok, 512, max_tokens=16 * 512 * 2)
batch = windows[:16]
dev = model.device
ids, lengths, input_ids, mask = C.right_padded(batch, dev)
B, S = ids.shape
cfg = CaptureConfig()
storage = C.Storage.of(cfg, sites[0].num_experts, len(sites))
slots_np = np.concatenate([b * S + np.arange(n) for b, n in enumerate(lengths)])
slots = torch.from_numpy(slots_np).to(dev)
with torch.inference_mode():
    fwd = lambda: model(input_ids=input_ids, attention_mask=mask, use_cache=False)
    res["forward_ms"] = timeit(fwd)
    rec = RouterRecorder(sites, True)
    with rec:
        def fh():
            o = model(input_ids=input_ids, attention_mask=mask, use_cache=False); rec.collect(B * S); return o
        res["forward_hooks_collect_ms"] = timeit(fh)
        o = model(input_ids=input_ids, attention_mask=mask, use_cache=False); routing = rec.collect(B * S)
    res["routing_parts_ms"] = timeit(lambda: C._routing_parts(routing, slots, storage, None))
    res["nll_old_ms"] = timeit(lambda: old_nll(o.logits, input_ids))
    res["nll_new_ms"] = timeit(lambda: C.token_nll(o.logits, input_ids))
    from traces.capture import nll as N
    res["nll_uses_kernel"] = N.uses_kernel(o.logits)
    res["routing_parts_noslots_ms"] = timeit(lambda: C._routing_parts(routing, None, storage, None))
    a, b = old_nll(o.logits, input_ids), C.token_nll(o.logits, input_ids)
    res["nll_max_abs_diff"] = float((a - b).abs().nan_to_num().max())
    parts = C._routing_parts(routing, slots, storage, None)
    parts["nll"] = C.token_nll(o.logits, input_ids).reshape(-1).index_select(0, slots)
    res["d2h_MB"] = round(sum(t.numel() * t.element_size() for t in parts.values()) / 1e6, 1)
    def d2h():
        return {k: v.to("cpu", non_blocking=False) for k, v in parts.items()}
    res["d2h_ms"] = timeit(d2h)
    host = {k: v.numpy() for k, v in d2h().items()}
pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
cols = dict(seq=np.repeat([w.seq for w in batch], lengths).astype(np.int32), pos=pos,
            phase=np.where(pos < 0, 0, 1).astype(np.int8), token_id=ids.reshape(-1)[slots_np].astype(np.int32),
            domain=np.repeat([w.domain for w in batch], lengths).astype(np.int16), **host)
meta = C.build_meta(model, sites, name, domains, cfg, {}, False)
unit = C.auto_unit_tokens(meta)  # 1/16 of the default row group, as when profiled
res["unit_tokens"] = unit
tmp = Path(tempfile.mkdtemp())
one = {k: v[:unit] for k, v in cols.items()}
ts = []
for i in range(7):
    t = time.perf_counter(); _write_unit(tmp / f"u{i}.parquet", meta, unit, None, one); ts.append(time.perf_counter() - t)
res["unit_encode_ms"] = round(statistics.median(ts[1:]) * 1e3, 1)
# the close's tail: 8,192 tokens written at once, then close (processes, default encoders)
def tail(nfwd, workers=None):
    stamps = {}
    orig_stop, orig_end = ParallelTraceWriter._stop_workers, ParallelTraceWriter._end_join
    def stop(self):
        orig_stop(self); stamps["encoded"] = time.perf_counter()
    def end(self, keep):
        orig_end(self, keep); stamps["joined"] = time.perf_counter()
    ParallelTraceWriter._stop_workers, ParallelTraceWriter._end_join = stop, end
    try:
        p = tmp / "t.parquet"
        w = ParallelTraceWriter(p, meta, unit, workers, processes=True)
        t = time.perf_counter()
        for f in range(nfwd):
            c = dict(cols); c["seq"] = cols["seq"] + 16 * f
            w.write(**c)
        wrote = time.perf_counter()
        w.close(); closed = time.perf_counter()
        p.unlink()
        return {"write_s": round(wrote - t, 3), "encoded_s": round(stamps["encoded"] - wrote, 3),
                "joined_s": round(stamps["joined"] - stamps["encoded"], 3), "close_s": round(closed - wrote, 3)}
    finally:
        ParallelTraceWriter._stop_workers, ParallelTraceWriter._end_join = orig_stop, orig_end
tail(1)
res["tail_1fwd"] = [tail(1) for _ in range(3)]
print(json.dumps(res, indent=1), flush=True)
(out / "devprof.json").write_text(json.dumps(res, indent=1))
