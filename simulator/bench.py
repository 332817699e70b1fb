"""moe-bench: how fast the simulator is, measured side by side (``make bench``).

Prints one Markdown report and writes it with ``--out`` (``make bench``: docs/BENCHMARKS.md):

- throughput of the Numba engine per policy on synthetic traces of three model shapes, with the
  plain-Python reference engine on a prefix of the same trace (ratio);
- libCacheSim's ``process_trace`` on the identical request stream (miss counts, ratio);
- JIT start-up cold (an empty ``NUMBA_CACHE_DIR``) and from the cache;
- one-pass miss-ratio curves against per-size runs; many configurations on two cores;
- a 1,000,000-token Qwen3-Next-shaped trace streamed from Parquet (peak RSS);
- a first run from Parquet at the target's size (51,200 tokens of the Qwen3-Next shape with full
  logits: a 2.5 GiB trace and its trace cache, written in ``--work-dir`` and removed after; with
  the large trace beside them, the scratch folder holds up to about 8 GiB).

Each measurement runs in a fresh subprocess (a *worker*), so peak memory is its own and JIT
start-up can be timed cold. Throughput is the CPU time of the simulating thread (per core), the
median of ``--repeats`` runs; wall-clock medians are given beside it. Traces are synthetic
(traces/synth.py), decode only, with full router logits unless noted.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np

from simulator import bench_baseline
from traces.atomic import atomic_write_text
from traces.errors import EXIT_INPUT_ERROR
from traces.provenance import source_commit

# ---- what is measured ---------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A model's routing shape and the trace sizes measured on it (tokens)."""

    name: str
    model: str  # conf/model preset: expert sizes for the hardware model
    layers: int
    experts: int
    top_k: int
    tokens: int  # the trace (throughput, libCacheSim, MRC)
    ref_tokens: int  # prefix run by both engines

    @property
    def lookups_per_token(self) -> int:
        return self.layers * self.top_k


SHAPES = (
    Shape("Qwen3-Next-80B-A3B", "qwen3_next_80b_a3b", 48, 512, 10, tokens=4096, ref_tokens=256),
    Shape("Qwen3-30B-A3B", "qwen3_30b_a3b", 48, 128, 8, tokens=8192, ref_tokens=512),
    Shape("Mixtral-8x7B", "mixtral_8x7b", 32, 8, 2, tokens=65536, ref_tokens=4096),
)
POLICIES = {  # row label -> moe-sim overrides (cache: per_layer, fraction 0.25)
    "fetch_all+lru": ["policy=fetch_all", "cache.eviction=lru"],
    "fetch_all+lfu": ["policy=fetch_all", "cache.eviction=lfu"],
    "rule015+lru": ["policy=rule015", "cache.eviction=lru"],
    "rule015+lfu": ["policy=rule015", "cache.eviction=lfu"],
    "quality_first": ["policy=quality_first"],
    "speed_first": ["policy=speed_first"],
    "belady": ["policy=fetch_all", "cache.eviction=belady"],
}
LCS_FRACTION = 0.25  # libCacheSim comparison: one global cache of this share of all experts
MANY_FRACTIONS = (0.125, 0.25)  # simulate_many: every policy at each of these cache fractions
# rows of POLICIES with a minimal kernel of their own in the yardstick's rounds (simulator/yardstick.py):
# the prefix of their keys in the figures, and their label
MINIMAL_KERNELS = {"rule015+lru": ("rule_", "rule015 + LRU"), "fetch_all+lfu": ("lfu_", "fetch_all + LFU")}
SCALE_SHAPE = SHAPES[0]
SCALE_POLICIES = ("fetch_all+lru", "quality_first")  # the first also streamed from Parquet
FIRST_RUN_POLICIES = ("fetch_all+lru", "quality_first")  # each also run from Parquet, no trace cache
FIRST_RUN_REPEATS = 7
# the first-run target is set on a 50k-token full-logit trace of the first shape: measured at that
# size too (a trace of its own, fetch_all + LRU), where a run's fixed costs weigh as they do there
FIRST_RUN_TARGET_TOKENS = 51_200
# rounds of the throughput table at least (a run of the Qwen3-Next shape is 12-30 ms: 3 rounds
# gave rule015 + LRU 0.65x and 0.74x of fetch_all + LRU in two runs at one commit, 2026-12-07)
THROUGHPUT_ROUNDS = 9
# Why the missed targets are missed, and what the kernel does about the ones it meets. Kept here,
# beside the code that measures, so the report states them; re-examine after kernel changes.
NOTES = """\
- **What the kernel leaves out (compile-time, `simulator.policies.kernel_needs`).** Each kernel
  is specialised to what its policies read: frequencies only for a variant that reads them; the
  decode step's selection pass before its lookups only where something reads the selections
  there (a frequency substitute, an eviction's `on_select`); elsewhere the step counts and marks
  them where they are first read: at its first background arrival, whose trim must not evict
  them, or as each lookup comes (one pass fewer for LFU, admission and prefetch); the layers' resident lists only
  for a substitute that scans them (logit substitution walks its top-R order, which never holds
  a selected expert, and its rare exact scan tests every expert of the layer); the background
  queue, its completions and the use of arrivals only where admission or prefetch can queue
  one; the gate and the miss rule only where the rule can leave a miss; and, for LRU where
  every pool holds k experts, the marks of a decode step's lookups (a trim never reaches a
  resident used in the step: used residents are its last victims), and there a decode step's
  trim passes no stamp (`state.NO_STAMP`), so the LRU victim is the list's head with no load of
  its mark; for LFU where nothing arrives in the background, no mark either: every use stores
  its step in `last_use`, one of the heap's keys, so the trim is passed the step
  (`state.step_stamp`) and tells the step's used residents by it. Outside the kernel's
  loop: ids read as stored (int16: no widening per chunk), synchronous fetches timed in one
  loop without a host-RAM tier and without a division (they are of the step's layer), an
  evicted expert's size from its pool where the pool's layers share one (else its layer from a
  table), and calls, hits, evictions and zero-mass steps derived after
  the run. Same results throughout (the engines' equivalence, fuzz and pinned-summary tests).
- **Unsigned indices.** Numba indexes an array with a signed integer through a wrap of negative
  values (a compare and a select on every access, on the chain of loads a lookup waits for); the
  ids, pools, token rows and heap positions the kernel knows to be >= 0 index as unsigned 32-bit
  (`simulator.jit.ix`). Side by side against the tree before (2a7c68a), each policy's time
  over the minimal kernel's in the same process (`python docs/bench/trees_side_by_side.py
  BEFORE .`: the Qwen3-Next shape, 4,096 tokens, 3 alternating processes per tree of 7 rounds):
  fetch_all + LRU 1.63-1.70x -> 1.45-1.59x, fetch_all + LFU 3.84-4.23x -> 2.70-3.09x,
  quality_first 4.13-4.41x -> 3.25-3.76x, rule015 + LRU 2.02-2.09x -> 1.90-2.04x. The minimal
  kernels keep signed indices: they are the yardstick as first measured.
- **fetch_all + LRU <= 9 ns per lookup.** The minimal kernel itself runs at
  {yard_ns} ns per lookup on this machine (Qwen3-Next), and the engine keeps a clock, byte
  budgets, per-token outputs and the policies' hooks beside it; the ratio target (1.5x) says how
  much that generality costs. Part of the cost was per chunk, not per lookup: the trace cache
  served runs that read no logits in chunks sized for float32 logits (7 kernel calls for this
  trace, each with its dispatch); its chunks are views, now sized by what the run decodes (one
  call here; 12.2 -> 9.5 ns between the bench runs at 3a03748 and 93011cd). Part was per run:
  a 4,096-token run spent 2.6 ms of its ~28 ms outside the kernel, most of it in memory it had
  just allocated and the host faulted in (this VM pays a few microseconds per fresh page). The
  result now takes the kernel's own arrays (the 0.8 MB mass histogram, a one-chunk run's outputs)
  instead of copies, the link's queue and host-RAM-tier arrays are empty where a run never
  touches them, and the trace cache's chunks are not checked again (the validating reader decoded
  them): about 1.0 ms outside the kernel. Side by side (`python docs/bench/trees_side_by_side.py`,
  6 processes per tree of 9 rounds): fetch_all + LRU 1.53-1.76x -> 1.47-1.55x the minimal kernel.
  Then the two loads an eviction made beyond the minimal kernel's: the victim's mark (never the
  step's where the trim cannot reach a used resident) and its layer (for a size its pool already says), each in
  an array of L x E entries that the minimal kernel does not have, so a likely cache miss per
  eviction; an LRU use moves its entry in one step and not at all where it is the newest (as the
  minimal kernel's does); the layout derived once per run, the link's per-step fetch list one
  layer long, the trace cache's chunk plan kept. Side by side (6 processes per tree of 9 rounds,
  ec8b33e against 37af3a0): fetch_all + LRU 1.49-1.53x -> 1.35-1.44x; rule015 + LRU and
  fetch_all + LFU unchanged (1.87-1.99x / 1.88-2.11x, 2.72-2.95x / 2.71-3.09x). The trim
  without a mark load wherever it cannot reach a used resident (LRU, every pool holding a step;
  also where the step substitutes) then took rule015 + LRU 2.09-2.45x -> 1.91-2.10x (b92f1a2
  against ec8b33e, 5 processes per tree of 9 rounds). On this VM the
  ratio also moves with the machine's state: when the minimal kernel itself runs 25 % slower
  (other work on the host), the engine's share over it grows, and shorter comparisons of the
  same two trees have come out equal. The target was set when the plain lookup took 13.4 ns at
  e0acac8, so it asks for 13.4 / 9 = 1.49x that engine's speed. Side by side in this run (the
  section *Against e0acac8*, `simulator/bench_baseline.py`: each tree in processes of its own,
  taking turns, on the same synthetic routing, with equal hits), fetch_all + LRU runs
  {base_speedup} as fast as e0acac8's for the whole call and {base_kernel} for the kernel alone:
  {base_scaled} ns per lookup on the scale the target was set on. A time per lookup is also the
  machine's: e0acac8's whole call took 19.4 ns per lookup in its own bench run of 2026-11-29 and
  {base_ns} ns in this one.
- **What substitution and LFU themselves cost.** `yardstick.rule_counts` is rule015 + LRU in the
  least code that gives its counts (the gate of each miss, the walk of the top-R order with its
  rows prefetched, the exact scan after it; hits, substitutions and fetches checked equal). In
  the same rounds on the Qwen3-Next shape it runs at {rule_min} the lookups/s of the minimal
  fetch_all + LRU kernel (the engine's two: {rule_eng}): the share that substitution's own work
  sets, whatever engine runs it. The engine's rule015 + LRU is {rule_over} its minimal kernel,
  its fetch_all + LRU {fa_over}. For LFU, `yardstick.lfu_hits` (a textbook heap per layer,
  re-keyed at every selection; the same hits) runs at {lfu_min} the minimal LRU's lookups/s, and
  the engine's fetch_all + LFU at {lfu_eng} of its fetch_all + LRU, in {lfu_over} the textbook
  kernel's time. Tried side by side and left out for no measured gain (alternating processes,
  medians and minima of 11-15 rounds): the walk without its mark test (a resident in the order
  is never marked before the walk passes it), a walk that tests four candidates per branch,
  and the LRU lists' two links of an expert in one cache line (fetch_all + LRU 18.0-18.4 -> 19.0-21.7 ms: slower). An LRU kept as a log of
  uses, pruned lazily at the trim (a hit is three stores, no loads), ran at 0.63x the linked
  list's speed in the minimal kernel: a victim then costs a read of every stale use before it.
- **Substitution and LFU against fetch_all + LRU.** The three shares fall as fetch_all + LRU
  gets faster (at kernel commit abe017a they were met, at 43 M lookups/s for fetch_all + LRU; at
  cb286df, fetch_all + LRU at 1.63x the minimal kernel, 0.48x, 0.79x and 0.52x; at ec8b33e, at
  1.36x, 0.34x, 0.65x and 0.46x; at 4acfb91, with the frequency order's two passes fewer, at
  1.46x, 0.40x, 0.79x and 0.59x: quality_first's share is the one at its limit; at d51c3d8, at
  1.33x, 0.42x, 0.71x and 0.53x, all three met; at 86a554a, with the counts derived after the run
  (below), at 1.14x, 0.38x, 0.62x and 0.46x, none met, though the three policies themselves ran
  as fast as before or faster: quality_first 36.1 -> 38.0, rule015 + LRU 60.6 -> 62.9, fetch_all +
  LFU 45.5 -> 46.5 M lookups/s, fetch_all + LRU 85.6 -> 101.0); at 6f46eb0, with LFU's step
  marks where experts arrive in the background (below), at 1.13x, 0.40x, 0.63x and 0.48x:
  quality_first 38.0 -> 40.6, rule015 + LRU 62.9 -> 63.2, fetch_all + LFU 46.5 -> 48.0 M
  lookups/s, fetch_all + LRU 101.0 -> 100.3; quality_first's share is met again. Where
  fetch_all + LRU runs at f times its minimal kernel, rule015 + LRU meets 0.7x only within
  f x m / 0.7 of its own minimal kernel (m: the minimal kernels' share, 0.64x when first
  measured, 0.60x in the runs since): 1.37x at f = 1.5 and m = 0.64, 1.24x at f = 1.36; at f = 1.14 and m = 0.60, 0.98x:
  rule015 + LRU would have to run faster than the least code that does its work (it runs at
  1.09x of it), so the 0.7x share now asks for a cheaper substitution, not a leaner engine.
  What a substituting policy pays beyond a lookup: the gate and the miss rule per miss, the
  top-R walk and a substitute's use. The walk's order rows are read once each, in trace order:
  a step's first walk prefetches the next two steps' rows, and the 800 KB mass histogram is
  counted in batches of 4,096 steps (both were stalls on memory; together rule015 + LRU 0.58x
  -> 0.64-0.66x, quality_first 0.28-0.30x -> 0.33-0.35x side by side, and 0.34-0.42x across
  two bench runs). Of what is left, the walk is not the cost: it looks at 1.67 candidates per
  substitution. The mass histogram is part of it: with 1,000 bins instead of 100,000 (one process,
  21 rounds) rule015 + LRU went 0.645 -> 0.686x, with 10,000 0.657x; its resolution is the
  results' (mass percentiles), so it stays. Its 100,000 bins in uint16 counts (200 KB instead of
  800 KB; a bin's 65,536th count spilling into an int64 copy, exact) gave no gain side by side
  (2026-12-06, docs/bench/trees_side_by_side.py, 5 processes of 9 rounds per tree: rule015 +
  LRU 1.82-1.90x -> 1.83-1.90x the minimal kernel, quality_first 2.97-3.34x -> 2.96-3.21x,
  fetch_all + LRU 1.15-1.19x -> 1.18-1.22x): left out. quality_first and fetch_all + LFU pay the frequency
  order: an indexed heap per pool with lazily refreshed keys, and recent admissions held out of it
  (91 % of fetch_all + LFU's victims at Qwen3-Next, sorted at each trim). Side by side (Qwen3-Next
  shape, 4,096 tokens): LFU's selection pass with LRU's order runs at 0.88x fetch_all + LRU, so
  the gap is the order, and the trim is about 60 % of fetch_all + LFU's kernel samples (perf). Of
  that, the held sort's loads cost, not its comparisons (dropping them gained nothing), and
  checking each held victim against the heap's top, with the stale-top refreshes this sets off, is
  about a sixth of the kernel. A sorted list per pool with lazily refreshed keys (short walks
  instead of sifts) matched the reference on every test and was slower (fetch_all + LFU 56-64 ->
  61-63 ms, rule015 + LFU 38 -> 49 ms): dropped. Frequency buckets (for the undecayed default,
  `cache.lfu_decay` 1: a used resident moves to the next count's bucket, or its bucket of one
  takes the new count in place; O(1) per use) kept the reference's residents group by group (the
  structure tests) and the heap's hits, and were slower side by side (4,096 tokens, 7 rounds,
  medians): fetch_all + LFU 85 -> 110 ms, quality_first 82 -> 138 ms, rule015 + LFU 57 -> 106 ms.
  With lazy keys a hit is one store; a bucket is moved at 46 % of the uses (a remove and an
  insert). Buckets with lazily stored keys (a use records its step; a trim moves the residents it
  meets whose keys rose) gave the heap's hits at about its speed: fetch_all + LFU 63 -> 66 ms,
  quality_first 66 -> 68 ms, rule015 + LFU 44 -> 47 ms (9 rounds). Both dropped: the order's cost
  is the same work in another place. Nor is it the working set: the ratio is the same at 128
  experts as at 512 (0.347x and 0.34x in the table above), with four times less state per
  layer. Nor the number of held residents a trim leaves out of the heap
  (`structures.KEEP_HELD`, 4): side by side (3 processes per tree of 7 rounds, fetch_all + LFU
  over the minimal kernel) 2 ran slower (2.42-2.44x -> 2.51-2.54x) and 8 no faster
  (2.23-2.40x -> 2.38-2.42x). Then two passes of work fewer per lookup, with the same order: a step's frequencies counted as its lookups come (no selection pass where nothing
  reads them before), and no marks where the heap's own last-use key tells which residents the
  step used (no background arrivals). Side by side (4acfb91 against 25af103, 4 processes per tree
  of 7 rounds, each policy over the minimal kernel): fetch_all + LFU 2.83-3.17x -> 2.40-2.55x,
  rule015 + LFU 2.19-2.38x -> 1.94-2.15x, quality_first 3.44-3.81x -> 3.22-3.80x (it admits in
  the background, so it kept its marks until 687815a: *Step marks with background arrivals*
  below), fetch_all + LRU 1.40-1.47x -> 1.36-1.45x and rule015 +
  LRU 1.93-2.05x -> 1.83-1.99x. What quality_first pays beyond rule015 + LFU is its background
  admission (74,015 arrivals on this trace, each inserted, trimmed for and mostly evicted again
  unused: 42,523 wasted): with beta = inf it runs at the speed of rule015 + LFU. Counted at
  75946a8 (4,096 tokens of the Qwen3-Next shape): per step, fetch_all + LFU trims 0.90 times and
  evicts 2.29 residents, 2.11 of them held ones (per trim 7.4 held looked at, 4.0 of them sorted;
  per step 0.28 stale tops refreshed and 0.21 pushes). About 30 % of its kernel's perf samples
  fall in the held sort, most on the test of each held one's last use. Left out for no measured
  gain (processes alternating with the current tree's, 30-40 repeats each, medians): the step's own
  admissions kept apart in the held list, so that their test is a branch the processor predicts
  (41.0 -> 40.8 ms, 9 processes each); the unmarked held ones checked against the heap's top once
  per trim instead of once per victim (no gain, 3 each); their keys prefetched at the step's
  start (41.3 -> 43.4 ms, 5 each: slower); `last_use` as int32 (42.0 -> 41.4 ms, 5 each: within
  the noise); for fetch_all + LRU, the lists' links as int16 (19.3 -> 19.8 ms, 5 each: slower).
  Counting the mass histogram's bins is about 3 % of rule015 + LRU's time (31.3 -> 30.4 ms with
  it left out). Measured at e2b354b and left out too: the held sort's and the heap's test of an
  arrival's `core.fresh` skipped where nothing arrives in the background (the array passed as
  None; fetch_all + LFU 40.9-41.7 -> 40.6-41.1 ms, medians 41.5 -> 40.6 ms, 3 processes each,
  about 2 %, less than the share lacks, and the eviction's victim hook would have to learn at
  compile time whether the kernel queues background transfers); the marks as int32 for rule015
  + LRU (30.6-31.5 -> 31.0-31.6 ms, 3 each: no gain). Measured at 6a2456e and left out (30
  repeats a process, medians): each step asking the CPU for the next layer's selected experts'
  residency and frequency entries (fetch_all + LRU 19.0 -> 21.8 ms, three layers ahead 24.5 ms;
  fetch_all + LFU 40.9 -> 42.2 and 43.0 ms: slower, the entries are in cache already);
  frequencies as integers where they do not decay (fetch_all + LFU 40.2 and 42.6 ms against
  40.9-41.7: within the noise). Measured at 4c33ece and left out (3 processes of 30 repeats
  each, rule015 + LRU at 31.0-32.2 ms): the walk testing 8 (or 4) candidates at once, their
  residency gathered into a bit mask and the first taken by its trailing zeros, no branch per
  candidate (33.1-33.8 ms: slower); the order rows loaded 2 and 3 (or 3 and 4) steps ahead
  instead of 1 and 2 (31.1-32.7 ms: no gain); the mass buffer at 1,024 or 65,536 steps instead
  of 4,096 (30.8-31.7 ms: no gain). As probes, not candidates: the walk without its test of the
  step's marks (30.8-31.8 ms: its stall is not that load) and 1,000 mass bins (30.3-31.1 ms,
  about 3 %). For fetch_all + LFU (41.3 ms): the frequencies and last uses side by side in one
  array, an expert's two keys in one cache line (43.2-44.3 ms: slower); `last_use` and the
  heap's stored last uses both as int32, 196 KB less state (41.0-41.9 ms against 41.2-42.1:
  no gain). Where rule015 + LRU's time goes (at 087fa2f, 3 rounds of 10 repeats, alternating,
  the same 4,096 tokens): with `policy.tau=0` (the rule's kernel, every miss fetched) 19.5-19.8
  ms, as fetch_all + LRU (19.4-20.6); with `policy.tau=1e-9` (misses may be left, none is: no
  substitution) 22.6-24.0 ms; with `policy.tau=0.05` (8,003 substitutions) 23.8-25.1 ms;
  rule015 (542,314) 31.1-31.8 ms. So about 4 ms of the 11-12 ms is the kernel that can leave a
  miss, before any substitution, and 7-8 ms the substitutions (about 14 ns each). Tried on the
  4 ms and left out: the rule without its short-circuit, `(rank < r) | (gate >= tau)`, one
  branch (tau=1e-9 24.0-25.4 ms: no gain); the substitute's walk not inlined into the kernel
  (tau=1e-9 22.6-22.8 ms, rule015 31.1-31.5: within the noise). Taken apart at 69c763c (the
  kernel's own CPU time, tau=1e-9 over tau=0 in the same process, medians of 15-25 rounds): the
  rank loop's miss-rule block costs it all (with the block compiled out, 1.00-1.02x), and no
  part of it is large on its own: the block without the walk 1.26x, with only the gate's load,
  the rule's test and a count 1.25x, the test and the count alone, no load, 1.13-1.17x, though
  that test's branch is never taken. The hot loop's machine code reloads the arrays' pointers
  from the stack (the kernel keeps more values live than there are registers), and each added
  value moves more of them there. A flat index for a step's ranks and gates (one offset per
  step) made fetch_all + LRU slower side by side (1.17-1.25x -> 1.32-1.33x the minimal kernel,
  3 processes of 9 rounds per tree) and rule015 + LRU no faster; a step's hits derived from its
  other counts, one counter fewer in the rank loop, gained nothing (fetch_all + LRU 1.19-1.23x ->
  1.15-1.30x, rule015 + LRU 1.92-2.07x -> 1.96-2.10x): both left out. Measured at cc09f74 for
  fetch_all + LFU and left out (the same 4,096 tokens, processes of 30 repeats alternating with
  the tree's own): frequencies as float32 and `last_use` as int32 together, 196 KB of state
  less (medians 41.9 -> 41.0 ms, 6 each: about 2 %, and float32 cannot hold the decayed
  increments); with it, the held sort's `fresh` test left out where nothing arrives in the
  background (41.5 -> 40.5 ms); and the held residents inserted in the step since its pool's
  last trim not tested at all (they are last used in it), with `fresh` read for them only where
  experts arrive in the background (8 each, on a host whose times moved by a third: minima
  41.7 -> 41.9 ms, no gain). A 4-ary heap (half the depth, a node's children side by side; at
  36d7ab5, `docs/bench/trees_side_by_side.py`, 5 processes per tree of 9 rounds, each policy over
  the minimal kernel): fetch_all + LFU 2.52-2.67x -> 2.59-2.91x, quality_first 3.13-3.46x ->
  3.29-3.91x, slower, left out. What fetch_all + LFU then lacked of 0.5x was 4-8 %.
  Another structure, probed outside the engine (`docs/bench/lfu_scan_probe.py`, 25 rounds, the
  same 4,096 tokens and hits): each layer's residents' keys packed in one int64 (selections, last
  use, id; the step's used ones flagged until its trim), a use one store, a victim the least key
  of the layer's array, a minimum LLVM vectorises (four lanes of AVX2). Its minimal kernel took
  2.00x the minimal LRU's time (0.50x the lookups/s; the textbook heap 5.98x), and the engine's
  fetch_all + LFU 2.14x its fetch_all + LRU's: the engine's LFU is 1.23x the probe where its LRU
  is 1.15x the minimal one (a second run: 1.94x, 2.14x, 1.25x and 1.13x), so the scan could gain
  at most 7-10 %, to about 0.5x. Its victim costs a pass over the pool (128 keys: about 21 ns
  even from L1; prefetching the next layer's keys gained nothing), so a global pool of thousands of residents would still need the heap.
  At 32 residents a layer (`--shape Qwen3-30B-A3B --tokens 8192`) the probe took 1.74x the
  minimal LRU's time and the engine's LFU 2.13x its LRU's (1.36x the probe, its LRU 1.08x the
  minimal one): about a fifth to gain there, where the target is not set; at Mixtral's 2 (65,536
  tokens) the engine's LFU is already at 1.35x its LRU. Built into the engine since da25c50:
  *Packed keys in small per-layer pools*, below.
- **Packed keys in small per-layer pools.** lfu, lru and belady may run their order on another structure
  with the same victims where it is faster (an eviction's optional `kernel_hooks`; the twin is
  the one reference, and `tests/test_engine_eviction.py` runs both structures against it). Each
  per-layer pool of at most 384 residents keeps its residents' keys in one int64 each
  (`structures.Packed`), a use is one store and a victim the least key of its pool. lfu's key is
  (selections, step of the last use, id), where frequencies do not decay; the trim's pass reads
  the keys of the step's own uses with bit 62 set, so they come last and no flag is stored
  (`eviction/_lfu_scan.py`). lru's is (ordinal of the last use, id), where the miss rule leaves
  misses: a step then uses about 9.7 residents and evicts 0.35, where fetch_all + LRU evicts 1.9
  a step, and there the lists stay faster (17.6 against 11.7 ms on a scan; `eviction/_lru_scan.py`).
  lru's does not apply where experts arrive in the background (an arrival's trim must keep the
  step's selections, which a list's marks tell and an ordinal does not), neither where the run's
  length is not known or the keys would not fit 62 bits (lfu at the Qwen3-Next shape: runs of
  fewer than 2^20 tokens); those runs keep the heap or the lists. The probe's scan above was much faster than the engine's first one (33.4 ms,
  slower than the heap's 28): indexed as `keys[off + j]`, a signed index Numba may have to wrap,
  the pass is not vectorised (46 ns for 138 keys, against 9.7 ns indexed from 0 in a view of
  the pool). Side by side (79bed13 against d3e5b95, `docs/bench/trees_side_by_side.py`, the
  Qwen3-Next shape, 4,096 tokens, 3 processes per tree of 9 rounds, each policy over the minimal
  kernel): fetch_all + LFU 2.68-2.70x -> 2.09-2.20x, rule015 + LFU 2.18-2.22x -> 1.81-1.91x,
  rule015 + LRU 1.96-1.97x -> 1.73-1.81x; fetch_all + LRU (1.15-1.16x / 1.16-1.18x) and
  quality_first (3.04-3.33x / 3.09-3.19x), which keep their structures, unchanged. In those
  rounds fetch_all + LFU went from 0.43x to 0.53-0.56x the lookups/s of fetch_all + LRU, and
  rule015 + LRU from 0.59x to 0.64-0.68x. In one process (11 rounds, CPU time of the whole
  run): at 32 residents a layer (Qwen3-30B-A3B, 8,192 tokens) fetch_all + LFU ran at 0.54x
  fetch_all + LRU, at Mixtral's 2 (65,536 tokens) at 0.85x. Then lfu's keys also where experts
  arrive in the background: an arrival that its own trim kept and the step did not select is
  unused in the step (`state.FRESH`), which a key whose step is the trim's cannot tell; the
  kernel now calls the eviction's optional `on_fresh` there, and the key takes a bit below its
  id, with which the trim's pass does not read it as the step's. Side by side (d3e5b95 against
  e7237ed, 3 processes per tree of 9 rounds): quality_first 3.06-3.20x -> 2.65-3.02x, speed_first
  3.01-3.18x -> 2.62-2.95x, rule015 + LFU (1.79-1.83x / 1.81-1.85x) and fetch_all + LFU
  (2.02-2.13x / 2.01-2.14x) unchanged. A first version tested residency in every use (before an
  arrival the kernel uses each selection, resident or not): rule015 + LFU 1.80-1.86x ->
  1.90-1.92x; a non-member's slot now points at a spare entry instead, so the store needs no
  test. belady runs packed keys too (`eviction/_belady_scan.py`, where nothing arrives in the
  background): (how far the next selection is, id, step of the last use), the step below the id
  so that it decides no order and tells the trim's pass the step's uses; every selection stores
  its resident's key (its next use moves), where the heap sifted it. Side by side (04a8e0f
  against 9072ee1, 3 processes per tree of 9 rounds): belady 4.13-4.25x -> 2.17-2.24x the
  minimal kernel, fetch_all + LRU unchanged (1.14-1.15x / 1.15-1.17x). Against the reference on
  the bench's prefixes (one process, medians of 7): Qwen3-30B-A3B 91x -> 165x, Qwen3-Next 84x -> 134x.
- **The logit walk, two candidates at once.** A substitution walks the token-layer's top-R order
  from where the step's last one stopped; a candidate qualifies if it is resident (a selected
  expert is not in the order, and a substitute the step used lies behind the walk's position, so
  the walk's test of the marks could never fail). It tested one candidate per branch, taken at
  random (1.67 candidates a substitution). It now tests the next two with one branch and picks
  the first by a select. Side by side (668bdc9 against 5500809, 3 processes per tree of 9
  rounds): rule015 + LRU 1.80-1.92x -> 1.60-1.62x the minimal kernel, quality_first 2.70-2.95x ->
  2.53-2.75x, fetch_all + LRU unchanged; in one process (11 rounds) rule015 + LRU ran at 0.70x
  fetch_all + LRU's lookups/s, quality_first at 0.43x. Four candidates at once were slower
  (rule015 + LRU 1.71-1.80x); the two with their mark test kept, 1.71-1.79x (against 1.76-1.85x).
  The steps with substituted mass are now counted from the mass histogram after the run, not in
  each step (da09423 against 668bdc9: rule015 + LRU 1.80-1.85x -> 1.79-1.82x, within the noise;
  one counter less).
- **A first run from Parquet.** Timed over all the process's threads since 65647c8 (Arrow
  decoded row groups on a pool of its own, which the calling thread's CPU time left out: the
  earlier 39-51 % were of the calling thread), and since 6196993 after an untimed 64-token run
  that loads the kernels, as for every other figure. What the read costs beyond the kernel, 4,096 tokens of this shape: the row groups
  of the columns fetch_all + LRU reads (pages verified) 18.9 -> 10.4 ms with LZ4 in place of
  zstd for the binary ids and gates; the gates and the weight check 6.8 + 2.1 -> 2.1 + 0.9 ms in
  one Numba pass each (the same float32 bits as NumPy's, whose summation order the pass
  follows and checks per width); and chunks that read only per-layer columns (the plan's scan
  keeps seq, pos, phase and domain). A whole first run side by side (02147c8 with its own zstd
  file against 6196993 with an LZ4 one, alternating processes, 3 x 15 runs, all threads'
  CPU): 63.2 -> 55.7 ms. The share moves between runs more than any other figure, and the
  faster kernel lowers it too (the same read over less kernel time). Medians of the first run
  in `make bench` on the same machine: de9bc4b 66 ms (36 %) and 49 ms (52 %); d51c3d8 76 ms
  (32 %) and 64 ms (35 %, the run shown). In the run shown its 7 samples were 71, 67, 66, 64,
  51, 52 and 53 ms: fast and slow runs of the one process, not a slower reader. The same
  measurement (`simulator.bench._first_run`, 7 runs) in a process of its own gives 52-55 ms on
  the same trace, about 45 % in the kernel. After the shape's other work in one process it
  depends on how much came before: 50 ms after `_work_shape` with one repeat, 78 falling to
  57 ms over the 7 rounds after three. Since 308b0de the bench measures a first run in a
  worker process of its own (`_work_first_run`), as a user's run is, and says which way each
  table was measured; the run shown is the first so measured (its samples: 69, 52, 53, 54,
  54, 53 and 54 ms). The target is set on a 50k-token trace, and until 2026-12-07 the target row
  took the shape's 4,096-token trace, where a run's fixed costs (the file's open, its footer
  and plan, the kernels' dispatch) weigh more. It now takes a run at the target's size
  (`FIRST_RUN_TARGET_TOKENS`, 51,200 tokens, a 2.5 GiB trace of its own, written and removed
  within the bench: about 40 s more). On this machine, one process per size, medians of 7:
  43 % at 4,096 tokens, 45 % at 51,200.
- **Numba >= 100x the reference.** The ratio is lowest where the Numba path is slowest, not
  where the reference is fastest (fetch_all + LRU: {fa_ref}). The reference's prefix keeps its
  top-R order since 965f1a7 (`ArraySource(keep_order=True)`, ranked once in the untimed run,
  as the trace cache keeps it), so the Numba engine walks the order there as it does in the
  throughput runs above, and the reference scans every resident; the results are compared.
  Before, the prefix kept no order and both engines scanned: the substituting policies on
  Qwen3-30B were 90-105x, now 272-476x (quality_first there: 94x -> 308x, results equal).
  belady is now the lowest. Its state set its first next-use keys in a Python loop over every
  expert of every layer, half of a 256-token run (one NumPy expression since e9697cc); its
  next-use rows went through a temporary file, whose creation, mapping and removal cost a
  short run more than its kernel (kept in memory up to 64 MiB since f35d6de); and a selected
  resident's re-key sifted both ways, though its key only moves toward the top (one inlined
  sift since de9bc4b; side by side, 4,096 Qwen3-Next tokens: 4.84-5.55x -> 4.75-4.85x the
  minimal kernel). belady against the reference, from 4acfb91: Qwen3-Next 65x -> 105-117x ->
  122-143x, Qwen3-30B 82x -> 80-104x -> 128x (a ratio moves by up to a fifth between runs).
- **libCacheSim.** Our exact per-lookup LRU and FIFO cost {ours_ns} ns (Qwen3 shapes, global
  pool), libCacheSim's `process_trace` {lcs_ns} ns per request including its trace reader; 10x
  would need {need_ns} ns per lookup. Where the question is the hit rate over cache sizes, the
  one-pass curve above answers it for every capacity at once, {curve} faster than a libCacheSim
  run per capacity, with identical counts.
- **Mixtral (top-2).** Per-step work (the clock and the synchronous fetches' timing, counters,
  trim) is spread over only two lookups: {mx_steps} M steps/s, {mx_lookups} M lookups/s
  (fetch_all + LRU).
- **The clock's chain.** The simulated clock is one chain of dependent float operations from
  step to step (non-expert time, the fetches' copies, the expert phase), so whatever lies on it
  is paid in full at every step. A copy's latency was read as `latency_us[1 if start > free
  else 0]`: a compare, then a load whose address waits for it, on that chain. It is now chosen
  by a branch (the link is idle or it is not; the branch is predicted, the chain keeps two
  adds), in the synchronous fetches and in every copy (`link._copy`), with the same sums in the
  same order (the engines' equivalence tests). Where nothing leaves a miss unfetched, a decode
  step's expert phase is k x the expert time, one precomputed value per layer. The kernel
  advances the background queue at each step's expert phase inlined (a call passed every array
  of the link's state: over a hundred words on the stack). Side by side (64b1c20 against the
  change, Qwen3-Next, 4,096 tokens, 3 processes per tree of 5 rounds, each policy over the
  minimal kernel): fetch_all + LRU 1.36-1.41x -> 1.31-1.34x, quality_first 3.21-3.39x ->
  2.84-3.04x, speed_first 3.20-3.36x -> 2.82-3.04x; rule015 + LRU (1.77-1.85x / 1.81-1.83x),
  fetch_all + LFU (2.40-2.47x / 2.45-2.49x), rule015 + LFU and belady unchanged. On Mixtral's
  global LRU (65,536 tokens, the libCacheSim comparison below, alternating processes) the
  ratio to libCacheSim went 2.86x and 2.99x -> 3.71x and 3.30x (libCacheSim itself ran at
  13-19 M requests/s in those runs); in three full `make bench` runs at d51c3d8 it was 2.99x,
  2.98x and 2.96x (2.7x at de9bc4b): still short of 3x by a hair. Tried and left out: a prefill step compiled apart from
  the kernel's loop (fewer live values in the decode path): fetch_all + LRU 1.28-1.32x ->
  1.15-1.24x, but rule015 + LRU 1.83-1.99x -> 1.91-2.10x.
- **Counts derived after the run.** The synchronous fetches' bytes (`RunCount.BYTES_FETCHED`)
  were added up in every step, a read-modify-write of memory beside the fetch count's. Without a
  host-RAM tier they are now derived after the run: the decode steps' from their layers' fetch
  counts, the prefill steps' from one sum the kernel keeps off the decode path
  (`kernel.derived_counts`, 86a554a; the same results in the engines' equivalence tests). Hand
  experiments on Mixtral's global LRU had found that dropping either of the step's two counter
  updates gained about a sixth, both together no more, and other stores in their place nothing:
  what the decode loop keeps live, not the store itself. Side by side (db39896 against the
  change, Qwen3-Next, 4,096 tokens, 3 processes per tree of 5 rounds, over the minimal kernel):
  fetch_all + LRU 1.33-1.34x -> 1.13-1.20x, and in a second comparison 1.32-1.41x ->
  1.14-1.24x; rule015 + LRU, quality_first and fetch_all + LFU unchanged within the noise.
  Mixtral's global LRU against libCacheSim, alternating processes: 3.03x and 2.98x -> 3.57x and
  3.56x. Dropping the fetch count's update as well gained nothing more (fetch_all + LRU
  1.13-1.16x -> 1.16-1.18x over the minimal kernel, 3 alternating processes of 9 rounds).
- **Step marks with background arrivals.** quality_first without admissions (beta = 1e9) ran
  28 % slower than rule015 + LFU with the same hits (39.9 against 31.1 ms, 4,096 tokens): the
  cost of a kernel that admits in the background even where nothing arrives. Knock-outs put
  most of it in the marks on every lookup (37.6 ms without them), little in the use of
  arrivals, the admission's accumulator or the queue's per-step test. LFU now tells a step's
  used residents by their last use also where experts arrive in the background (687815a): an
  arrival is inserted with the step as its last use, kept by its own trim, then left
  `state.FRESH` unless selected, and the victim search reads `core.fresh` for the residents last
  used in the step; before a step's first arrival the selections' last use becomes the step
  (stored without a test of residence: a test per selection cost more than the stores it
  saved, quality_first 2.93-2.98x -> 2.75-2.80x the minimal kernel without it). Side by side
  (a826f5c against the change, Qwen3-Next, 4,096 tokens, 5 alternating pairs of processes of 9
  rounds, medians over the minimal kernel): quality_first 2.90x -> 2.79x (processes: 2.88-3.12x
  -> 2.75-3.03x), speed_first 2.86x -> 2.77x, fetch_all + LFU 2.46x -> 2.41x; fetch_all + LRU
  unchanged. A gain of 3-4 %: the share of quality_first moves from about 0.39x to 0.41x of
  fetch_all + LRU in these rounds, and `make bench` at 6f46eb0 gave 0.40x (38.0 -> 40.6 M
  lookups/s; fetch_all + LFU 46.5 -> 48.0 M lookups/s, 0.46x -> 0.48x). A first version searched
  victims by marks or by last use in two inlined copies, and a test run spent minutes in
  Numba's inlining of the LFU kernels; the search is one copy again (the kernel always passes
  LFU the step), and the quality_first and fetch_all + LFU kernels compile in 53 and 43 s, as
  before the change (52 and 41 s). Same results in the engines' equivalence, eviction and
  prefetch tests.
- **Trace cache size on every shape.** A copy holds the float16 logits (2 B per expert and
  token-layer), the selections (2 B id and 4 B gate per rank) and, once a logit-substituting
  policy ran, the top-R order (2 B per entry): 1.18x the logits at 512 experts and top-10. At
  8 experts and top-2 (Mixtral) the selections alone are 75 % of the logits, so no copy that
  holds them meets +20 %; at 128 experts and top-8 the selections are 19 % and the order of 64
  ids adds 50 %.
- **Compile time (the JIT start-up's cold row).** Numba compiles a function inlined at its IR
  level again at each call site, with all it inlines: the LFU kernels spent most of their
  compile inlining the trim (three sites), which inlines the victim search (two copies of the
  heap's pop, each with two sifts). Since 7de253f the kernel's trim has one call site per step,
  the victim search one pop, and the background arrivals' loop sits under its compile-time
  constant, which Numba prunes before it inlines (a kernel without background transfers no
  longer compiles an arrival's trim). Cold, one process per tree, an 8-token trace
  (`simulate` per bench row with an empty `NUMBA_CACHE_DIR`): fetch_all + LFU 48.0 -> 15.1 s,
  rule015 + LFU 47.2 -> 15.9 s, quality_first 60.3 -> 39.1 s, fetch_all + LRU 9.5 -> 8.1 s,
  belady 11.9 -> 7.9 s; all rows 185 -> 93 s. The test suite's CPU time (`pytest -n 2`, one run
  each) fell from 28.3 to 23.8 minutes. Side by side (`docs/bench/trees_side_by_side.py`, 5 processes per tree) the times
  did not move: fetch_all + LFU 2.40-2.57x -> 2.41-2.56x the minimal kernel, quality_first
  2.92-3.40x -> 2.92-3.23x. Tried and left out: the heap's comparison and placement, or its
  sifts, compiled apart and inlined by LLVM (`forceinline`): LFU compiled in 19-26 s, but
  quality_first ran 3-5 % slower; one sift in the pop: fetch_all + LFU about 4 % slower.
"""
TARGETS = {
    "fetch_all_lookups_per_s": 50e6,
    "quality_first_lookups_per_s": 5e6,
    "numba_over_reference": 100.0,
    "numba_over_libcachesim": 10.0,
    "numba_over_libcachesim_lru": 3.0,  # LRU alone, misses equal request per step
    "scale_peak_rss_bytes": 1.5e9,
    "jit_from_cache_s": 2.0,
    # lookups/s as a share of fetch_all + LRU's, same shape and run (substitution near a lookup)
    "quality_first_over_fetch_all": 0.4,
    "rule015_lru_over_fetch_all": 0.7,
    "fetch_all_lfu_over_lru": 0.5,
    # fetch_all + LRU against the minimal kernel with the same hits (simulator/yardstick.py)
    "fetch_all_ns_per_lookup": 9.0,
    "fetch_all_over_yardstick": 1.5,
    # a first run from Parquet (no trace cache): the kernel's share of its CPU time
    "first_run_kernel_share": 0.4,
    # the trace cache's copy on disk against the trace's float16 logits
    "cache_over_logits": 1.2,
}


# ---- helpers shared by workers and tests --------------------------------------------------


def request_stream(source) -> np.ndarray:
    """int64[n]: the trace's expert lookups as cache keys ``layer * E + expert``, in trace order.

    Order: token, then layer, then rank. Decode-only traces (a prefill group is one lookup per
    unique expert, which a per-request cache simulator cannot express).
    """
    meta = source.meta
    base = (np.arange(meta.num_layers, dtype=np.int64) * meta.num_experts)[None, :, None]
    parts = []
    for c in source.iter_chunks():
        if c.num_tokens and (c.phase != 1).any():
            raise ValueError("request_stream needs a decode-only trace (no prefill tokens)")
        parts.append((c.experts.astype(np.int64) + base).ravel())
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def stream_source(keys: np.ndarray, expert_bytes: int):
    """A one-layer, top-1 trace whose steps are the requests ``keys`` (one lookup per step).

    The engine run on it sees exactly the request sequence a per-request cache simulator sees.
    """
    from traces.format import ArraySource, TraceMeta, make_chunk

    n = int(keys.shape[0])
    num_experts = int(keys.max()) + 1 if n else 1
    meta = TraceMeta(model="request-stream", num_layers=1, num_experts=num_experts, top_k=1,
                     expert_bytes=[int(expert_bytes)], source="bench")
    chunk = make_chunk(meta, seq=np.zeros(n, np.int32), pos=np.arange(n, dtype=np.int32),
                       phase=np.ones(n, np.int8), experts=keys.reshape(n, 1, 1),
                       weights=np.ones((n, 1, 1), np.float32))
    return ArraySource(meta, chunk)


_ORACLE_GENERAL = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])


def write_oracle_general(keys: np.ndarray, path: str | os.PathLike) -> None:
    """Write requests as libCacheSim's binary ``oracleGeneral`` trace (every object 1 byte)."""
    rec = np.zeros(keys.shape[0], _ORACLE_GENERAL)
    rec["time"] = np.arange(keys.shape[0]) % 2**32
    rec["id"] = keys
    rec["size"] = 1
    rec["next"] = -1
    rec.tofile(path)


def libcachesim_misses(path: str | os.PathLike, eviction: str, capacity: int, n: int,
                       objects: int | None = None):
    """(misses, CPU seconds) of libCacheSim's ``process_trace`` (C++ reader) on an oracleGeneral
    file of ``n`` requests, with an ``lru`` or ``fifo`` cache of ``capacity`` objects.

    ``objects`` (distinct keys, e.g. L*E) sizes libCacheSim's hash table to fit, instead of its
    default 2**24 buckets whose set-up would dominate a short stream.
    """
    import libcachesim as lcs

    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    hashpower = max(10, int(objects - 1).bit_length() + 1) if objects else 24
    cache = {"lru": lcs.LRU, "fifo": lcs.FIFO}[eviction](capacity, hashpower=hashpower)
    t = time.thread_time()
    miss_ratio, _ = cache.process_trace(reader)
    return round(miss_ratio * n), time.thread_time() - t


def sim_params(meta, overrides: list[str]):
    """SimParams of the moe-sim config these overrides compose, for a trace with ``meta``."""
    from omegaconf import OmegaConf

    from simulator.run import build_params, compose

    # speed, not feasibility: the cache sizes up to every expert need not fit the profile's GPU
    cfg = OmegaConf.to_container(compose(["memory.check=false", *overrides]), resolve=True)
    return build_params(cfg, meta)[0]


def _timed(fn, clock=time.thread_time):
    """(result, CPU seconds of this thread, wall seconds); ``clock=time.process_time`` counts
    every thread of the process (Arrow decodes Parquet on a pool of its own)."""
    c, w = clock(), time.perf_counter()
    out = fn()
    return out, clock() - c, time.perf_counter() - w


def _peak_rss_reset() -> bool:
    """Reset this process's peak RSS (Linux ``clear_refs``); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    """Peak resident memory of this process (since the last reset where supported)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- workers (each runs in its own process) -----------------------------------------------


def _work_shape(task: dict) -> dict:
    """Throughput per policy, engines side by side, MRC and libCacheSim on one shape's trace."""
    from simulator.engine import simulate
    from simulator.mrc import mrc
    from simulator.trace_cache import cached_source
    from traces.format import ArraySource, concat_chunks
    from traces.sources import LimitedSource

    repeats = task["repeats"]
    t = time.perf_counter()
    source = cached_source(task["trace"], task["cache_dir"])
    open_s = time.perf_counter() - t
    meta = source.meta
    model = [f"model={task['model']}"]
    out = {"open_from_cache_s": open_s, "baseline_rss": _peak_rss_bytes(), "policies": {}}

    prefix = LimitedSource(source, task["ref_tokens"])
    # the prefix keeps its top-R order as the trace cache does: the Numba engine walks it there
    # as in the throughput runs (the reference scans; the results are compared)
    small = ArraySource(meta, concat_chunks(list(prefix.iter_chunks())), keep_order=True)
    runs = {name: sim_params(meta, overrides + model) for name, overrides in POLICIES.items()}
    for params in runs.values():
        # loads the kernels, and builds what the trace cache and the prefix keep for later runs
        # (the top-R order of the first logit-substituting policy: ~0.8 s here, which a timed
        # round would otherwise carry); not timed
        simulate(source, params)
        simulate(small, params)
    if task.get("compile_only"):  # a process of its own compiles: its memory is not counted
        return {}
    cpu = {name: [] for name in runs}
    wall = {name: [] for name in runs}
    peak = dict.fromkeys(runs, 0)
    last = {}
    # in rounds over the policies, not one policy's repeats back to back: the machine's speed
    # drifts (fetch_all + LRU has moved 25-40 M lookups/s between runs), and the ratios between
    # policies are the targets
    out["rounds"] = max(repeats, THROUGHPUT_ROUNDS)
    for _ in range(out["rounds"]):
        for name, params in runs.items():
            _peak_rss_reset()
            last[name], c, w = _timed(lambda p=params: simulate(source, p))
            cpu[name].append(c)
            wall[name].append(w)
            peak[name] = max(peak[name], _peak_rss_bytes())
    for name, params in runs.items():
        r = last[name]
        row = {
            "cpu_s": cpu[name], "wall_s": wall[name], "peak_rss": peak[name],
            "lookups": int(r.layer_calls.sum()), "steps": int(r.phase.shape[0]) * meta.num_layers,
            "hit_rate": float(r.layer_hits.sum() / r.layer_calls.sum()),
            "substitution_rate": float(r.layer_substitutions.sum() / r.layer_calls.sum()),
        }
        numba_cpu, ref_cpu = [], []
        for _ in range(repeats):
            a, c, _ = _timed(lambda p=params: simulate(small, p))
            numba_cpu.append(c)
            b, c, _ = _timed(lambda p=params: simulate(small, p, engine="reference"))
            ref_cpu.append(c)
        row.update(ref_tokens=small.num_tokens, ref_numba_cpu_s=numba_cpu, ref_cpu_s=ref_cpu,
                   ref_equal=_same_result(a, b))
        out["policies"][name] = row

    out["yardstick"] = _yardstick(source, model, repeats)

    # one-pass miss-ratio curve against the per-size runs it replaces
    E = meta.num_experts
    fa = POLICIES["fetch_all+lru"] + model
    mrc_cpu = []
    for _ in range(repeats):
        curve, c, _ = _timed(lambda: mrc(source, "per_layer"))
        mrc_cpu.append(c)
    sizes = sorted({1, max(1, E // 8), max(1, E // 4), max(1, E // 2), E})
    checks = []
    for size in sizes:
        params = sim_params(meta, fa + [f"cache.fraction={min(1.0, (size + 0.5) / E)}"])
        r = simulate(source, params)
        checks.append(int(r.layer_hits.sum()) == int(curve.decode_hits[size]))
    glob = mrc(source, "global")
    budget = (meta.num_layers * E // 4) * int(meta.expert_bytes[0])
    params = sim_params(meta, ["policy=fetch_all", "cache.eviction=lru", "cache=global",
                               f"cache.budget_bytes={budget}"])
    r = simulate(source, params)
    checks.append(int(r.layer_hits.sum()) == int(glob.decode_hits[glob.size_of(budget_bytes=budget)]))
    out["mrc"] = {"cpu_s": mrc_cpu, "sizes": E, "checked_sizes": sizes + ["global"],
                  "equal": all(checks), "run_cpu_s": out["policies"]["fetch_all+lru"]["cpu_s"]}

    out["libcachesim"] = _libcachesim(source, task, repeats)
    return out


def _yardstick(source, model: list[str], repeats: int) -> dict:
    """The minimal kernels (simulator/yardstick.py) on the same trace and cache size as the
    fetch_all + LRU, rule015 + LRU and fetch_all + LFU rows, timed in rounds with those rows'
    whole ``simulate`` calls (one of each in turn, so all see the machine's drift): the CPU time
    of each, and whether the counts are equal (hits; hits, substitutions and fetches; hits)."""
    from simulator.engine import read_options, simulate
    from simulator.yardstick import lfu_hits, lru_hits, rule_counts

    meta = source.meta
    params = sim_params(meta, POLICIES["fetch_all+lru"] + model)
    rule = sim_params(meta, POLICIES["rule015+lru"] + model)
    lfu = sim_params(meta, POLICIES["fetch_all+lfu"] + model)
    capacity = int(params.pool_budget_bytes[0] // int(params.expert_bytes[0]))  # the model's sizes
    chunks = list(source.iter_chunks(**read_options(rule, source)))  # float16 logits, the top-R order
    experts = np.concatenate([c.experts for c in chunks])
    rule_args = (experts, np.concatenate([c.gates for c in chunks]),
                 np.concatenate([c.logit_order for c in chunks]), np.concatenate([c.logits for c in chunks]),
                 meta.num_experts, capacity, rule.protect_ranks, rule.tau)
    del chunks
    engine_hits = simulate(source, params).layer_hits
    r = simulate(source, rule)
    engine_rule = np.stack([r.layer_hits, r.layer_substitutions, r.layer_fetches], axis=1)
    engine_lfu = simulate(source, lfu).layer_hits
    hits = lru_hits(experts, meta.num_experts, capacity)  # compiles or loads; not timed
    counts = rule_counts(*rule_args)
    lfu_equal = bool(np.array_equal(lfu_hits(experts, meta.num_experts, capacity), engine_lfu))
    cpu, engine_cpu, rule_cpu, rule_engine_cpu, lfu_cpu, lfu_engine_cpu = [], [], [], [], [], []
    for _ in range(2 * repeats):
        engine_cpu.append(_timed(lambda: simulate(source, params))[1])
        cpu.append(_timed(lambda: lru_hits(experts, meta.num_experts, capacity))[1])
        rule_engine_cpu.append(_timed(lambda: simulate(source, rule))[1])
        rule_cpu.append(_timed(lambda: rule_counts(*rule_args))[1])
        lfu_engine_cpu.append(_timed(lambda: simulate(source, lfu))[1])
        lfu_cpu.append(_timed(lambda: lfu_hits(experts, meta.num_experts, capacity))[1])
    return {"cpu_s": cpu, "lookups": int(experts.size), "capacity": capacity,
            "equal": bool(np.array_equal(hits, engine_hits)), "engine_cpu_s": engine_cpu,
            "rule_cpu_s": rule_cpu, "rule_engine_cpu_s": rule_engine_cpu,
            "rule_equal": bool(np.array_equal(counts, engine_rule)),
            "rule_substitutions": int(counts[:, 1].sum()),
            "lfu_cpu_s": lfu_cpu, "lfu_engine_cpu_s": lfu_engine_cpu, "lfu_equal": lfu_equal}


def _work_first_run(task: dict) -> dict:
    """A first run in a process of its own, as a user's ``moe-sim`` run is. Measured at the end
    of the shape's worker, after its hundreds of runs, it came out 10-50 % slower and falling
    from round to round (78 -> 57 ms over 7 rounds, where a fresh process gives 52-55 ms)."""
    from traces.format import open_trace

    with open_trace(task["trace"]) as reader:
        meta = reader.meta
    # a first run's read varies more than the kernel does (48 and 64 ms in two runs of 3): 7 at least
    return _first_run(task["trace"], meta, [f"model={task['model']}"],
                      max(task["repeats"], FIRST_RUN_REPEATS))


def _work_first_run_target(task: dict) -> dict:
    """The first run at the target's size (FIRST_RUN_TARGET_TOKENS), in a process of its own:
    fetch_all + LRU from Parquet (:func:`_first_run`), then the same run from the trace cache
    (the kernel alone, this thread's CPU, as the throughput table's), as many runs of each."""
    from simulator.engine import simulate
    from simulator.trace_cache import cached_source
    from traces.format import open_trace

    with open_trace(task["trace"]) as reader:
        meta, tokens = reader.meta, reader.num_tokens
    model, repeats = [f"model={task['model']}"], max(task["repeats"], FIRST_RUN_REPEATS)
    out = _first_run(task["trace"], meta, model, repeats, ("fetch_all+lru",))["fetch_all+lru"]
    t = time.perf_counter()
    source = cached_source(task["trace"], task["cache_dir"])
    params = sim_params(meta, POLICIES["fetch_all+lru"] + model)
    simulate(source, params)  # builds the trace cache: not timed
    out["cache_build_s"] = time.perf_counter() - t
    out["cache_cpu_s"] = [_timed(lambda: simulate(source, params))[1] for _ in range(repeats)]
    out["tokens"] = tokens
    return out


def _first_run(trace: str, meta, model: list[str], repeats: int, policies=FIRST_RUN_POLICIES) -> dict:
    """CPU s of a run straight from the Parquet file (no trace cache: what a first run pays) per
    policy of ``policies``, of all the process's threads (Arrow's decode included), after an
    untimed run on the first 64 tokens (the kernels loaded, as for every other figure); the
    kernel's part is the same run's CPU from the trace cache."""
    from simulator.engine import read_options, simulate
    from traces.format import open_trace
    from traces.sources import LimitedSource

    out = {}
    for name in policies:
        params = sim_params(meta, POLICIES[name] + model)
        with open_trace(trace) as reader:  # kernels and the reader's checks loaded: not timed
            simulate(LimitedSource(reader, 64), params)
        cpu = []
        for _ in range(repeats):
            with open_trace(trace) as reader:
                _, c, _ = _timed(lambda r=reader, p=params: simulate(r, p), time.process_time)
            cpu.append(c)
        out[name] = {"parquet_cpu_s": cpu, "reads_logits": bool(read_options(params)["logits"])}
    return out


def _same_result(a, b) -> bool:
    names = ("layer_calls", "layer_hits", "layer_fetches", "layer_substitutions", "layer_mass",
             "time_us", "mass", "mass_hist")
    return all(np.array_equal(getattr(a, n), getattr(b, n)) for n in names) and (
        a.evictions == b.evictions and a.background_admissions == b.background_admissions)


def _libcachesim(source, task: dict, repeats: int) -> dict:
    """Miss counts and CPU time of libCacheSim and of our engine on the same request stream."""
    from simulator.engine import simulate

    meta = source.meta
    keys = request_stream(source)
    n = int(keys.shape[0])
    path = Path(task["work_dir"]) / f"{Path(task['trace']).stem}.oracleGeneral.bin"
    write_oracle_general(keys, path)
    capacity = max(meta.top_k, int(LCS_FRACTION * meta.num_layers * meta.num_experts))
    eb = int(meta.expert_bytes[0])
    flat = stream_source(keys, eb)
    out = {"requests": n, "capacity": capacity, "policies": {}}
    for ev in ("lru", "fifo"):
        overrides = ["policy=fetch_all", f"cache.eviction={ev}", "cache=global",
                     f"cache.budget_bytes={capacity * eb}"]
        lcs_cpu, ours_cpu = [], []
        params = sim_params(meta, overrides)
        simulate(source, params)  # loads the kernel; not timed
        for _ in range(repeats):  # in rounds, one of each in turn: both see the machine's drift
            lcs_miss, c = libcachesim_misses(path, ev, capacity, n,
                                             meta.num_layers * meta.num_experts)
            lcs_cpu.append(c)
            r, c, _ = _timed(lambda p=params: simulate(source, p))
            ours_cpu.append(c)
        per_request = simulate(flat, sim_params(flat.meta, overrides))
        out["policies"][ev] = {
            "lcs_misses": lcs_miss, "lcs_cpu_s": lcs_cpu,
            "stream_misses": int(per_request.layer_fetches.sum()),
            "step_misses": int(r.layer_fetches.sum()), "ours_cpu_s": ours_cpu,
        }
    # the one-pass LRU curve of the request stream: every capacity at once, libCacheSim's exactly
    from simulator.mrc import mrc

    mrc_cpu = []
    for _ in range(repeats):
        curve, c, _ = _timed(lambda: mrc(flat, "global"))
        mrc_cpu.append(c)
    out["stream_mrc"] = {"cpu_s": mrc_cpu, "sizes": curve.max_size + 1,
                         "lru_misses": n - int(curve.decode_hits[capacity])}
    path.unlink()
    return out


def _work_jit(task: dict) -> dict:
    """Seconds to import the engines and make the first call of every kernel (tiny trace)."""
    t0 = time.perf_counter()
    import simulator.engine as engine
    import simulator.mrc as mrc_module
    from traces.format import ArraySource
    from traces.synth import synth_trace

    import_s = time.perf_counter() - t0
    meta, chunk = synth_trace(8, 4, 16, 2, seed=0, logits="full", prompt_share=0.5,
                              prompt_tokens=3, seq_tokens=4)
    source = ArraySource(meta, chunk)
    params = {name: sim_params(meta, ov) for name, ov in POLICIES.items()}
    t = time.perf_counter()
    for p in params.values():
        engine.simulate(source, p)
    engine_s = time.perf_counter() - t
    t = time.perf_counter()
    mrc_module.mrc(source, "per_layer")
    mrc_s = time.perf_counter() - t
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    return {"import_s": import_s, "engine_first_calls_s": engine_s, "mrc_first_call_s": mrc_s,
            "process_cpu_s": cpu.ru_utime + cpu.ru_stime}


def _work_synth(task: dict) -> dict:
    from traces.synth import write_synth_trace

    s = task["shape"]
    t = time.perf_counter()
    write_synth_trace(task["path"], task["tokens"], s["layers"], s["experts"], s["top_k"],
                      seed=task["seed"], logits=task["logits"], prompt_share=0.0)
    return {"wall_s": time.perf_counter() - t, "bytes": os.path.getsize(task["path"])}


def _work_scale(task: dict) -> dict:
    """A large trace: streamed from Parquet, then decoded into the trace cache and run from
    there per policy; time and peak RSS of each pass."""
    from simulator.engine import simulate
    from simulator.trace_cache import cached_source
    from traces.format import open_trace
    from traces.sources import LimitedSource

    reader = open_trace(task["trace"])
    model = [f"model={task['model']}"]
    passes = {}

    def measure(label, fn, lookups=True):
        _peak_rss_reset()
        r, c, w = _timed(fn)
        passes[label] = {"cpu_s": c, "wall_s": w, "peak_rss": _peak_rss_bytes()}
        if lookups:
            passes[label].update(lookups=int(r.layer_calls.sum()),
                                 hit_rate=float(r.layer_hits.sum() / r.layer_calls.sum()))
        return r

    params = {name: sim_params(reader.meta, POLICIES[name] + model) for name in SCALE_POLICIES}
    first = SCALE_POLICIES[0]
    for p in params.values():  # kernels loaded (or compiled) before any pass: not timed
        simulate(LimitedSource(reader, 64), p)
    if task.get("compile_only"):  # a process of its own compiles: its memory is not counted
        return {}
    measure(f"Parquet, {first}", lambda: simulate(reader, params[first]))
    def build():
        source = cached_source(task["trace"], task["cache_dir"])
        source.build()  # a trace cache builds lazily, on its first pass, unless told now
        return source

    cached = measure("decode into the trace cache", build, lookups=False)
    for name, p in params.items():
        measure(f"trace cache, {name}", lambda p=p: simulate(cached, p))
    shutil.rmtree(cached.directory)
    return {"tokens": reader.num_tokens, "passes": passes}


def _work_many(task: dict) -> dict:
    """simulate_many on one and on all cores; results must equal one another."""
    from simulator.engine import simulate
    from simulator.engine.many import default_workers, simulate_many
    from simulator.trace_cache import cached_source

    source = cached_source(task["trace"], task["cache_dir"])
    model = [f"model={task['model']}"]
    params = [sim_params(source.meta, ov + model + [f"cache.fraction={f}"])
              for ov in POLICIES.values() for f in MANY_FRACTIONS]
    for p in params[: len(POLICIES)]:
        simulate(source, p, chunk_tokens=64)  # JIT load, not timed (chunk size is irrelevant)
    out = {"configs": len(params), "workers": default_workers(), "runs": {}}
    results = []
    for workers in (1, out["workers"]):
        cpu0 = _process_cpu_s()
        rs, _, w = _timed(lambda n=workers: simulate_many(source, params, workers=n))
        out["runs"][workers] = {"wall_s": w, "process_cpu_s": _process_cpu_s() - cpu0}
        results.append(rs)
    out["equal"] = all(_same_result(a, b) for a, b in zip(*results, strict=True))
    return out


def _process_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


WORKERS = {"shape": _work_shape, "first_run": _work_first_run, "first_run_target": _work_first_run_target,
           "jit": _work_jit,
           "synth": _work_synth, "scale": _work_scale, "many": _work_many}


def _spawn(task: dict, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "simulator.bench", "--worker", json.dumps(task)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _collect(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"bench worker failed ({proc.returncode}):\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _run(task: dict, env: dict | None = None) -> dict:
    return _collect(_spawn(task, env))


# ---- the run and its report ---------------------------------------------------------------


def _say(msg: str) -> None:
    print(f"[moe-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_bench(repeats: int, scale_tokens: int, work_dir: Path, token_scale: float) -> dict:
    """Run every measurement; returns the raw figures (JSON-able)."""
    from simulator.trace_cache import _dir_bytes, cached_source
    from traces.format import open_trace

    started = time.perf_counter()
    cache_dir = work_dir / "cache"
    shapes = [Shape(s.name, s.model, s.layers, s.experts, s.top_k,
                    max(64, int(s.tokens * token_scale)), min(s.ref_tokens, max(64, int(s.tokens * token_scale))))
              for s in SHAPES]
    figures: dict = {"started": time.strftime("%Y-%m-%d %H:%M"), "loadavg_start": os.getloadavg(),
                     "repeats": repeats, "shapes": {}, "kernel_commit": _kernel_commit(),
                     "machine": machine(), "first_run_own_process": True}

    scale_path = work_dir / "scale.parquet"
    scale_proc = None
    if scale_tokens:  # the large trace is written in the background (one core) meanwhile
        _say(f"writing a {scale_tokens:,}-token {SCALE_SHAPE.name} trace in the background")
        scale_proc = _spawn({"kind": "synth", "path": str(scale_path), "tokens": scale_tokens,
                             "shape": SCALE_SHAPE.__dict__, "seed": 1, "logits": "none"})

    traces = {}
    for s in shapes:
        path = work_dir / f"{s.model}.parquet"
        _say(f"synthesising {s.tokens} tokens of {s.name}")
        info = _run({"kind": "synth", "path": str(path), "tokens": s.tokens, "shape": s.__dict__,
                     "seed": 0, "logits": "full"})
        t = time.perf_counter()
        with open_trace(path) as reader:
            for _ in reader.iter_chunks():
                pass
        decode_s = time.perf_counter() - t
        t = time.perf_counter()
        cached_source(path, cache_dir).build()
        build_s = time.perf_counter() - t
        traces[s.name] = path
        figures["shapes"][s.name] = {"shape": s.__dict__, "trace_bytes": info["bytes"],
                                     "parquet_decode_s": decode_s, "cache_build_s": build_s,
                                     "logits_f16_bytes": s.tokens * s.layers * s.experts * 2}

    _say("JIT start-up: cold, then from cache")
    env = {"NUMBA_CACHE_DIR": tempfile.mkdtemp(prefix="numba-cache-", dir=work_dir)}
    figures["jit_cold"] = _run({"kind": "jit"}, env)
    figures["jit_cached"] = [_run({"kind": "jit"}, env) for _ in range(repeats)]

    for s in shapes:
        _say(f"{s.name}: policies, reference engine, MRC, libCacheSim")
        task = {"kind": "shape", "trace": str(traces[s.name]), "cache_dir": str(cache_dir),
                "model": s.model, "ref_tokens": s.ref_tokens, "repeats": repeats,
                "work_dir": str(work_dir)}
        # the policies' kernels that Numba's cache lacks (all of them after a change of the
        # engine or a policy) are compiled in a process of their own, as for the scale passes:
        # compiling in the measuring process raised every policy's peak RSS by about 300 MiB
        _run(dict(task, compile_only=True))
        figures["shapes"][s.name].update(_run(task))
        figures["shapes"][s.name]["first_run"] = _run({"kind": "first_run", "trace": task["trace"],
                                                       "model": s.model, "repeats": repeats})

    for s in shapes:  # the copy with what the runs added to it (top-R logit ids)
        figures["shapes"][s.name]["cache_bytes"] = _dir_bytes(cached_source(traces[s.name], cache_dir).directory)

    lead = shapes[0]
    tokens = max(64, int(FIRST_RUN_TARGET_TOKENS * token_scale))
    _say(f"{lead.name}: a first run at the target's size, {tokens:,} tokens")
    path, target_cache = work_dir / f"{lead.model}_first_run.parquet", work_dir / "cache_first_run"
    info = _run({"kind": "synth", "path": str(path), "tokens": tokens, "shape": lead.__dict__,
                 "seed": 2, "logits": "full"})
    figures["first_run_target"] = {"shape": lead.name, "trace_bytes": info["bytes"], "synth_s": info["wall_s"],
                                   **_run({"kind": "first_run_target", "trace": str(path), "model": lead.model,
                                           "cache_dir": str(target_cache), "repeats": repeats})}
    path.unlink()  # gigabytes: gone before the scale passes
    shutil.rmtree(target_cache, ignore_errors=True)

    if scale_proc is not None:
        _say("waiting for the large trace")
        figures["scale_synth"] = _collect(scale_proc)
        _say("streaming the large trace through the engine")
        task = {"kind": "scale", "trace": str(scale_path), "model": SCALE_SHAPE.model,
                "cache_dir": str(cache_dir)}
        _run(dict(task, compile_only=True))  # as for the shapes
        figures["scale"] = _run(task)
        scale_path.unlink()

    _say(f"fetch_all + LRU against {bench_baseline.COMMIT}, side by side")
    lead = shapes[0]
    try:
        figures["baseline"] = bench_baseline.measure(Path(__file__).resolve().parent.parent, work_dir,
                                                     lead.__dict__, lead.model, repeats)
    except RuntimeError as exc:  # a baseline that no longer runs here: the report says why
        figures["baseline"] = {"commit": bench_baseline.COMMIT, "skipped": str(exc)}

    _say("simulate_many")
    many_shape = shapes[1]
    figures["many"] = _run({"kind": "many", "trace": str(traces[many_shape.name]),
                            "cache_dir": str(cache_dir), "model": many_shape.model})
    figures["many"]["shape"] = many_shape.name
    figures["loadavg_end"] = os.getloadavg()
    figures["total_s"] = time.perf_counter() - started
    return figures


def _kernel_commit(paths: tuple[str, ...] = ("engine", "policies", "jit.py")) -> str:
    """The last commit of the engines' and policies' sources (``paths``, relative to simulator/;
    ``..`` for the whole checkout), ``+`` when the working copy differs, or ``?``."""
    return source_commit(paths, Path(__file__).resolve().parent)


def _med(xs) -> float:
    return float(statistics.median(xs))


def _throughput_rounds(fig: dict) -> int:
    """The rounds of the throughput table (runs before THROUGHPUT_ROUNDS: the repeats)."""
    return max(fig["shapes"][s.name].get("rounds", fig["repeats"]) for s in SHAPES if s.name in fig["shapes"])


def _rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _targets(fig: dict) -> list[tuple[str, str, str, bool | None]]:
    """(target, measured, comparison, met) for the issue's targets."""
    first = fig["shapes"][SHAPES[0].name]["policies"]
    rows = []

    def lookups(p):
        return _rate(p["lookups"], _med(p["cpu_s"]))

    fa = lookups(first["fetch_all+lru"])
    rows.append(("fetch_all+LRU >= 50 M lookups/s, one core (Qwen3-Next)", f"{fa / 1e6:.1f} M/s",
                 f"{fa / TARGETS['fetch_all_lookups_per_s']:.2f}x target",
                 fa >= TARGETS["fetch_all_lookups_per_s"]))
    qf = lookups(first["quality_first"])
    rows.append(("quality_first (logit substitution) >= 5 M lookups/s (Qwen3-Next)",
                 f"{qf / 1e6:.2f} M/s", f"{qf / TARGETS['quality_first_lookups_per_s']:.2f}x target",
                 qf >= TARGETS["quality_first_lookups_per_s"]))
    for row, key, what in (("quality_first", "quality_first_over_fetch_all", "quality_first"),
                           ("rule015+lru", "rule015_lru_over_fetch_all", "rule015 + LRU"),
                           ("fetch_all+lfu", "fetch_all_lfu_over_lru", "fetch_all + LFU")):
        if row in first:
            share = lookups(first[row]) / fa
            y = fig["shapes"][SHAPES[0].name].get("yardstick", {})
            pre = MINIMAL_KERNELS.get(row, ("",))[0]
            minimal = (f" (minimal kernels: {_med(y['cpu_s']) / _med(y[pre + 'cpu_s']):.2f}x)"
                       if pre and pre + "cpu_s" in y else "")
            rows.append((f"{what} >= {TARGETS[key]:g}x the lookups/s of fetch_all + LRU (Qwen3-Next, "
                         "trace cache)", f"{share:.2f}x{minimal}", f"{share / TARGETS[key]:.2f}x target",
                         share >= TARGETS[key]))
    y = fig["shapes"][SHAPES[0].name].get("yardstick")
    if y:
        ns = _med(y["engine_cpu_s"]) / y["lookups"] * 1e9
        ratio = _yardstick_ratio(y)
        rows.append((f"fetch_all + LRU <= {TARGETS['fetch_all_ns_per_lookup']:g} ns per lookup (Qwen3-Next)",
                     f"{ns:.1f} ns", f"{ns / TARGETS['fetch_all_ns_per_lookup']:.2f}x limit",
                     ns <= TARGETS["fetch_all_ns_per_lookup"]))
        rows.append((f"fetch_all + LRU <= {TARGETS['fetch_all_over_yardstick']:g}x the minimal kernel "
                     "(Qwen3-Next, equal hits)", f"{ratio:.2f}x" + ("" if y["equal"] else " (hits DIFFER)"),
                     f"{ratio / TARGETS['fetch_all_over_yardstick']:.2f}x limit",
                     ratio <= TARGETS["fetch_all_over_yardstick"] and y["equal"]))
    b = fig.get("baseline", {})
    if "rounds" in b:
        sb = bench_baseline.summary(b)
        rows.append((f"fetch_all + LRU <= {b['target_ns']:g} ns per lookup, as the speed-up it asks of "
                     f"{b['commit']} ({b['set_ns']:g} ns then: {sb['needed']:.2f}x), side by side",
                     f"{sb['speedup']:.2f}x ({sb['scaled_ns']:.1f} ns on that scale)"
                     + ("" if sb["hits_equal"] else " (hits DIFFER)"),
                     f"{sb['speedup'] / sb['needed']:.2f}x target", sb["met"]))
    target = fig.get("first_run_target")
    fr = fig["shapes"][SHAPES[0].name].get("first_run", {}).get("fetch_all+lru")
    if target or fr:  # at the target's size where measured (figures since 2026-12-07), else the shape's
        share, tokens = ((_med(target["cache_cpu_s"]) / _med(target["parquet_cpu_s"]), target["tokens"]) if target
                         else (_med(first["fetch_all+lru"]["cpu_s"]) / _med(fr["parquet_cpu_s"]),
                               fig["shapes"][SHAPES[0].name]["shape"]["tokens"]))
        rows.append((f"kernel >= {TARGETS['first_run_kernel_share']:.0%} of a first run's CPU from Parquet "
                     f"(fetch_all + LRU, Qwen3-Next, full logits, {tokens:,} tokens)", f"{share:.0%}",
                     f"{share / TARGETS['first_run_kernel_share']:.2f}x target",
                     share >= TARGETS["first_run_kernel_share"]))
    sizes = [s["cache_bytes"] / s["logits_f16_bytes"] for s in fig["shapes"].values() if "cache_bytes" in s]
    lead = fig["shapes"][SHAPES[0].name]
    if "cache_bytes" in lead:
        size = lead["cache_bytes"] / lead["logits_f16_bytes"]
        rows.append((f"trace cache on disk <= float16 logits + {TARGETS['cache_over_logits'] - 1:.0%} "
                     "(Qwen3-Next, full logits)", f"{size:.2f}x", f"{size / TARGETS['cache_over_logits']:.2f}x limit",
                     size <= TARGETS["cache_over_logits"]))
    if sizes:
        rows.append((f"trace cache on disk <= float16 logits + {TARGETS['cache_over_logits'] - 1:.0%} "
                     "(every shape, full logits)", f"max {max(sizes):.2f}x",
                     f"{max(sizes) / TARGETS['cache_over_logits']:.2f}x limit",
                     max(sizes) <= TARGETS["cache_over_logits"]))
    ratios = [_med(p["ref_cpu_s"]) / _med(p["ref_numba_cpu_s"])
              for s in fig["shapes"].values() for p in s["policies"].values()]
    rows.append(("Numba >= 100x reference (every shape and policy)",
                 f"min {min(ratios):.0f}x, median {statistics.median(ratios):.0f}x",
                 f"{min(ratios) / TARGETS['numba_over_reference']:.2f}x target (min)",
                 min(ratios) >= TARGETS["numba_over_reference"]))
    lcs = [_med(p["lcs_cpu_s"]) / _med(p["ours_cpu_s"])
           for s in fig["shapes"].values() for p in s["libcachesim"]["policies"].values()]
    lru = [_med(s["libcachesim"]["policies"]["lru"]["lcs_cpu_s"]) / _med(s["libcachesim"]["policies"]["lru"]["ours_cpu_s"])
           for s in fig["shapes"].values()]
    equal = all(s["libcachesim"]["policies"]["lru"]["lcs_misses"] == s["libcachesim"]["policies"]["lru"]["stream_misses"]
                for s in fig["shapes"].values())
    rows.append((f">= {TARGETS['numba_over_libcachesim_lru']:g}x libCacheSim's LRU, identical misses in "
                 "request-per-step mode (every shape)",
                 f"min {min(lru):.1f}x, median {statistics.median(lru):.1f}x" + ("" if equal else " (misses DIFFER)"),
                 f"{min(lru) / TARGETS['numba_over_libcachesim_lru']:.2f}x target (min)",
                 min(lru) >= TARGETS["numba_over_libcachesim_lru"] and equal))
    rows.append((">= 10x libCacheSim process_trace (LRU and FIFO, every shape)",
                 f"min {min(lcs):.1f}x, median {statistics.median(lcs):.1f}x",
                 f"{min(lcs) / TARGETS['numba_over_libcachesim']:.2f}x target (min)",
                 min(lcs) >= TARGETS["numba_over_libcachesim"]))
    if "scale" in fig:
        rss = max(p["peak_rss"] for p in fig["scale"]["passes"].values())
        rows.append((f"peak RSS < 1.5 GB, {fig['scale']['tokens']:,} tokens (every pass)",
                     f"{rss / 2**20:.0f} MiB", f"{rss / TARGETS['scale_peak_rss_bytes']:.2f}x limit",
                     rss < TARGETS["scale_peak_rss_bytes"]))
    jit = _med([j["import_s"] + j["engine_first_calls_s"] for j in fig["jit_cached"]])
    rows.append(("JIT start-up from cache < 2 s (import + first call, 5 policies)", f"{jit:.2f} s",
                 f"{jit / TARGETS['jit_from_cache_s']:.2f}x limit", jit < TARGETS["jit_from_cache_s"]))
    return rows


def _yardstick_ratio(y: dict) -> float:
    """The engine's CPU over the minimal kernel's (fetch_all + LRU)."""
    return _rounds_ratio(y["engine_cpu_s"], y["cpu_s"])


def _rounds_ratio(engine: list[float], minimal: list[float]) -> float:
    """The median of the rounds' ratios where the two were timed in rounds (figures of earlier
    versions: the ratio of the medians)."""
    if len(engine) == len(minimal):
        return statistics.median(e / k for e, k in zip(engine, minimal, strict=True))
    return _med(engine) / _med(minimal)


def _baseline_section(b: dict | None) -> list[str]:
    """The report's lines on fetch_all + LRU against the commit the targets were set on."""
    if not b:  # figures of earlier versions
        return []
    head = [f"## Against {b['commit']}, the engine the targets were set on", ""]
    if "skipped" in b:
        return head + [f"Not measured: {b['skipped']}.", ""]
    sb = bench_baseline.summary(b)

    def cell(x):
        return "" if x is None else f"{x:.1f}"

    return head + [
        _table(["tree", "ns/lookup, whole call", "ns/lookup, kernel alone", "hits"],
               [[b["commit"], cell(sb["baseline_ns"]), cell(sb["baseline_kernel_ns"]), f"{sb['hits']:,}"],
                ["this one", cell(sb["ours_ns"]), cell(sb["ours_kernel_ns"]),
                 f"{sb['hits']:,}" if sb["hits_equal"] else "**differ**"]]),
        "",
        f"fetch_all + LRU on the Qwen3-Next shape ({b['tokens']:,} tokens, per-layer cache at 25 %), "
        f"{len(b['rounds'])} rounds, each one process of each tree taking turns (which goes first "
        f"alternates), each process the median of {b['calls']} calls after an untimed one; CPU time "
        "of the simulating thread. Each tree writes its own copy of the same synthetic routing "
        "(traces.synth, seed 0) and reads it from its own trace cache; the hits of every round are "
        "compared. Speed-up (the median of the rounds' ratios): "
        f"**{sb['speedup']:.2f}x** for the whole call"
        + (f", {sb['kernel_speedup']:.2f}x for the kernel alone" if sb["kernel_speedup"] is not None else "")
        + f". The target of {b['target_ns']:g} ns per lookup was set when {b['commit']} took "
        f"{b['set_ns']:g} ns, so it asks for {sb['needed']:.2f}x; a time per lookup also moves with "
        "the machine and its load (`simulator/bench_baseline.py`).",
        "",
    ]


def _cache_size_cells(s: dict) -> list[str]:
    """Trace cache MiB, float16 logits MiB and their ratio ('' for figures without them)."""
    if "cache_bytes" not in s:
        return ["", "", ""]
    mib = 2**20
    return [f"{s['cache_bytes'] / mib:.0f}", f"{s['logits_f16_bytes'] / mib:.0f}",
            f"{s['cache_bytes'] / s['logits_f16_bytes']:.2f}x"]


def machine() -> dict:
    """The machine and library versions a run measures on (kept in its figures)."""
    import numba

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "numba": numba.__version__, "numpy": np.__version__}


def render(fig: dict) -> str:
    """The Markdown report of a run's figures."""
    mib = 2**20
    m = fig.get("machine") or machine()  # figures of older runs did not record it
    out = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`python -m simulator.bench --out docs/BENCHMARKS.md --json "
        "docs/benchmarks.json`; `--from-json docs/benchmarks.json` renders the same figures again); "
        "do not edit by hand. The sweep throughput is the second half of `make bench`: "
        "docs/SWEEPS.md.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; Python {m['python']}, numba "
        f"{m['numba']}, numpy {m['numpy']}; engine and policies at commit {fig['kernel_commit']}. "
        f"Run {fig['started']}, "
        f"{fig['total_s'] / 60:.1f} min; load average {fig['loadavg_start'][0]:.1f} at the start, "
        f"{fig['loadavg_end'][0]:.1f} at the end (other work shares this machine, so wall times "
        "are noisy; throughput uses the CPU time of the simulating thread).",
        "",
        f"Figures are medians of {fig['repeats']} runs; the throughput table's, of "
        f"{_throughput_rounds(fig)} rounds (the policies timed in rounds, one run of each in turn, after an untimed run of each on the whole trace: kernels loaded, the trace cache's top-R order built). Traces: synthetic (traces/synth.py, seed 0), "
        "decode only, full router logits; cache per layer at 25 % of the experts, hardware "
        "h200_pcie5, the model preset's expert sizes. A *lookup* is one selected expert of one "
        "token at one layer (tokens x layers x top-k); a *step* is one token at one layer.",
        "",
        "## Throughput (one core) and the reference engine",
        "",
    ]
    rows = []
    for name, s in fig["shapes"].items():
        sh = s["shape"]
        for pol, p in s["policies"].items():
            c = _med(p["cpu_s"])
            rows.append([
                f"{name} ({sh['layers']}/{sh['experts']}/top-{sh['top_k']})", pol,
                f"{p['steps'] // sh['layers']:,}", f"{p['lookups']:,}",
                f"{_rate(p['lookups'], c) / 1e6:.2f}", f"{_rate(p['steps'], c) / 1e6:.3f}",
                f"{_med(p['wall_s']):.3f}", f"{p['peak_rss'] / mib:.0f}",
                f"{p['hit_rate']:.3f}", f"{p['substitution_rate']:.3f}",
                f"{_med(p['ref_cpu_s']) / _med(p['ref_numba_cpu_s']):.0f}x"
                + ("" if p["ref_equal"] else " (results DIFFER)"),
            ])
    out.append(_table(["shape (layers/experts/top-k)", "policy", "tokens", "lookups",
                       "M lookups/s", "M steps/s", "wall s", "peak RSS MiB", "hit rate",
                       "subst. rate", "Numba / reference"], rows))
    first = next(iter(fig["shapes"].values()))
    out += [
        "",
        "Peak RSS is the worker process's high-water mark during that policy's runs (trace mapped "
        f"from the trace cache; the process holds {first['baseline_rss'] / mib:.0f} MiB after its "
        "imports; kernels missing from Numba's cache were compiled in another process before). *Numba / reference*: CPU time of the reference engine over the Numba engine "
        "on the trace's first tokens ("
        + ", ".join(f"{s['shape']['name']}: {s['policies']['fetch_all+lru']['ref_tokens']}"
                    for s in fig["shapes"].values())
        + " tokens), both engines on the same chunks; their results are compared field by field.",
        "",
        "## The minimal kernel",
        "",
        _table(["shape", "capacity per layer", "lookups", "minimal kernel ns/lookup",
                "fetch_all + LRU ns/lookup", "engine / minimal", "hits equal"],
               [[s["shape"]["name"], f"{y['capacity']:,}", f"{y['lookups']:,}",
                 f"{_med(y['cpu_s']) / y['lookups'] * 1e9:.1f}",
                 f"{_med(y['engine_cpu_s']) / y['lookups'] * 1e9:.1f}",
                 f"{_yardstick_ratio(y):.2f}x", "yes" if y["equal"] else "**no**"]
                for s in fig["shapes"].values() for y in [s["yardstick"]]]),
        "",
        "The yardstick (`simulator/yardstick.py`): per-layer LRU, fetch every miss, the engine's "
        "step semantics and nothing else (no clock, byte budgets, frequencies or per-token "
        "outputs), on the same selections (CPU time of the kernel alone; the "
        "engine's row is the whole `simulate` call from the trace cache, the two timed in rounds, "
        "one of each in turn; *engine / minimal* is the median of the rounds' ratios). Equal hits "
        "per layer are checked.",
        "",
    ]
    other_rows = [[s["shape"]["name"], label, f"{_med(y[pre + 'cpu_s']) / y['lookups'] * 1e9:.1f}",
                   f"{_med(y[pre + 'engine_cpu_s']) / y['lookups'] * 1e9:.1f}",
                   f"{_rounds_ratio(y[pre + 'engine_cpu_s'], y[pre + 'cpu_s']):.2f}x",
                   f"{_med(y['cpu_s']) / _med(y[pre + 'cpu_s']):.2f}x",
                   f"{_med(y['engine_cpu_s']) / _med(y[pre + 'engine_cpu_s']):.2f}x",
                   "yes" if y[pre + "equal"] else "**no**"]
                  for s in fig["shapes"].values() for y in [s["yardstick"]]
                  for pre, label in MINIMAL_KERNELS.values() if pre + "cpu_s" in y]
    if other_rows:
        out += [
            _table(["shape", "policy", "minimal kernel ns/lookup", "engine ns/lookup", "engine / minimal",
                    "minimal: lookups/s / minimal fetch_all + LRU's", "engine: lookups/s / fetch_all + LRU's",
                    "counts equal"], other_rows),
            "",
            "The same for two more policies, timed in the same rounds. rule015 + LRU "
            "(`yardstick.rule_counts`): the 0.15 rule and logit substitution (the walk of the "
            "token-layer's top-R unselected logit ids, the exact scan after it) over the minimal "
            "LRU; hits, substitutions and fetches per layer checked equal. fetch_all + LFU "
            "(`yardstick.lfu_hits`): a textbook binary heap per layer keyed (selections, last use, "
            "id), re-keyed at every selection; hits checked equal. The *minimal* share is what the "
            "policy's own work costs against a plain lookup in the least code that does it: for "
            "substitution the gate of each miss, the rule's branches and the order's rows; for LFU "
            "the frequency order (the engine refreshes its heap's keys lazily and holds admissions "
            "out of it, so it may run faster than this kernel).",
            "",
        ]
    out += _baseline_section(fig.get("baseline"))
    out += [
        "## libCacheSim on the identical request stream",
        "",
    ]
    rows = []
    for name, s in fig["shapes"].items():
        lc = s["libcachesim"]
        n = lc["requests"]
        for ev, p in lc["policies"].items():
            ours, theirs = _med(p["ours_cpu_s"]), _med(p["lcs_cpu_s"])
            rows.append([
                name, ev.upper(), f"{lc['capacity']:,}", f"{n:,}", f"{p['lcs_misses']:,}",
                f"{p['stream_misses']:,}", "yes" if p["stream_misses"] == p["lcs_misses"] else "NO",
                f"{p['step_misses']:,} ({(p['step_misses'] - p['lcs_misses']) / max(1, p['lcs_misses']):+.3%})",
                f"{_rate(n, theirs) / 1e6:.1f}", f"{_rate(n, ours) / 1e6:.1f}", f"{theirs / ours:.1f}x",
            ])
    out.append(_table(["shape", "eviction", "capacity (experts)", "requests", "misses libCacheSim",
                       "misses ours, request per step", "equal", "misses ours, token-layer steps",
                       "libCacheSim M req/s", "ours M lookups/s", "ours / libCacheSim"], rows))
    out += [
        "",
        "Key = layer x E + expert, one cache over all layers (scope global, budget = capacity x "
        "expert bytes), fetch every miss, cold start; libCacheSim reads the stream as a binary "
        "oracleGeneral trace with its C++ reader. *Request per step*: our engine on the same "
        "stream as a one-layer top-1 trace, so each step is one request, as in libCacheSim; the "
        "counts must match exactly. *Token-layer steps*: the real trace, where a step's k lookups "
        "see the pool as it was at the step's start plus the step's own fetches "
        "(docs/semantics.md: residency never shrinks during a step), while a per-request "
        "simulator may evict a later rank of the same step to admit an earlier miss. Example "
        "(capacity 2, one layer): steps [A, B] then [C, A]: the engine keeps A through the second "
        "step (3 misses), LRU per request evicts A to admit C (4 misses). Throughput: CPU time of "
        "`process_trace` against our engine on the real trace (the way it is used).",
        "",
    ]
    rows = []
    for name, s in fig["shapes"].items():
        lc = s["libcachesim"]
        sm, lru = lc["stream_mrc"], lc["policies"]["lru"]
        one, theirs = _med(sm["cpu_s"]), _med(lru["lcs_cpu_s"])
        rows.append([name, f"{sm['sizes']:,}", f"{one:.3f}", f"{theirs:.3f}",
                     "yes" if sm["lru_misses"] == lru["lcs_misses"] else "NO",
                     f"{sm['sizes'] * theirs / one:,.0f}x"])
    out.append(_table(["shape", "capacities 0..L*E", "one-pass LRU curve CPU s",
                       "libCacheSim LRU, one capacity, CPU s", "equal at the capacity above",
                       "curve vs libCacheSim at every capacity"], rows))
    out += [
        "",
        "The request stream's LRU miss-ratio curve (`simulator.mrc.mrc` on the one-request-per-step "
        "trace) gives libCacheSim's LRU miss count at every capacity in one pass.",
        "",
        "## JIT start-up",
        "",
    ]
    cold = fig["jit_cold"]
    cached = fig["jit_cached"]
    rows = [
        ["cold (empty NUMBA_CACHE_DIR)", f"{cold['import_s']:.2f}", f"{cold['engine_first_calls_s']:.2f}",
         f"{cold['mrc_first_call_s']:.2f}", f"{cold['process_cpu_s']:.1f}"],
        ["from cache", f"{_med([j['import_s'] for j in cached]):.2f}",
         f"{_med([j['engine_first_calls_s'] for j in cached]):.2f}",
         f"{_med([j['mrc_first_call_s'] for j in cached]):.2f}",
         f"{_med([j['process_cpu_s'] for j in cached]):.1f}"],
    ]
    out.append(_table(["", "import s", "first call, 5 policies s", "first MRC call s",
                       "process CPU s"], rows))
    out += [
        "",
        "A fresh process imports the engines and runs each policy once on an 8-token trace "
        "(wall seconds); the cold run compiles every kernel.",
        "",
        "## One-pass miss-ratio curves, many configurations, trace cache",
        "",
    ]
    rows = []
    for name, s in fig["shapes"].items():
        m = s["mrc"]
        one, run = _med(m["cpu_s"]), _med(m["run_cpu_s"])
        rows.append([name, f"{m['sizes'] + 1}", f"{one:.3f}", f"{run:.3f}",
                     f"{(m['sizes'] + 1) * run / one:.0f}x", "yes" if m["equal"] else "NO",
                     ", ".join(str(x) for x in m["checked_sizes"])])
    out.append(_table(["shape", "cache sizes", "MRC CPU s", "one engine run CPU s",
                       "MRC vs all per-size runs", "equal to engine", "sizes checked"], rows))
    many = fig["many"]
    one, all_ = many["runs"]["1"], many["runs"][str(many["workers"])]
    out += [
        "",
        "MRC: `simulator.mrc.mrc(source, 'per_layer')`, hit rate at every per-layer size 0..E in "
        "one pass, against `fetch_all` + LRU runs of the engine; checked equal at the sizes listed "
        "and at one global budget.",
        "",
        f"`simulate_many` ({many['shape']}, {many['configs']} configurations: every policy at "
        f"cache fractions {', '.join(str(f) for f in MANY_FRACTIONS)}, one decoded trace): "
        f"{one['wall_s']:.2f} s wall on one thread, {all_['wall_s']:.2f} s on {many['workers']} "
        f"threads ({one['wall_s'] / all_['wall_s']:.2f}x), using {all_['process_cpu_s']:.2f} CPU s "
        f"({all_['process_cpu_s'] / all_['wall_s']:.2f} cores busy on average; the speed-up is "
        "bounded by the cores other work leaves free); results equal to one thread's: "
        f"{'yes' if many['equal'] else 'NO'}.",
        "",
    ]
    rows = [[name, f"{s['trace_bytes'] / mib:.0f}", f"{s['parquet_decode_s']:.2f}",
             f"{s['cache_build_s']:.2f}", f"{s['open_from_cache_s'] * 1e3:.1f}",
             *_cache_size_cells(s)]
            for name, s in fig["shapes"].items()]
    out.append(_table(["trace", "Parquet MiB", "Parquet decode s", "cache build s",
                       "open from cache ms", "trace cache MiB", "float16 logits MiB",
                       "cache / logits"], rows))
    out += ["", "Trace cache: its copy of the trace on disk after every run above (the top-R logit "
            "ids the substituting policies built included); float16 logits: tokens x layers x "
            "experts x 2 bytes."]
    rows = []
    for name, s in fig["shapes"].items():
        for policy, r in s.get("first_run", {}).items():
            kernel = _med(s["policies"][policy]["cpu_s"])
            parquet = _med(r["parquet_cpu_s"])
            rows.append([name, policy, "yes" if r["reads_logits"] else "no", f"{parquet:.3f}", f"{kernel:.3f}",
                         f"{kernel / parquet:.0%}"])
    if rows:
        where = ("in a process of its own, as a user's run is" if fig.get("first_run_own_process")
                 else "at the end of the shape's worker process")
        out += ["", "A first run, straight from the Parquet file (no trace cache; the columns the policy reads "
                f"are decoded as it streams; CPU s of all the process's threads; {where}), "
                "against the same run from the trace cache (the kernel alone, CPU s), medians (of "
                f"{max(fig['repeats'], FIRST_RUN_REPEATS)} runs from Parquet):", ""]
        out.append(_table(["trace", "policy", "reads logits", "from Parquet CPU s", "from the trace cache CPU s",
                           "kernel share"], rows))
    t = fig.get("first_run_target")
    if t:
        parquet, kernel = _med(t["parquet_cpu_s"]), _med(t["cache_cpu_s"])
        out += ["", f"At the target's size: {t['tokens']:,} tokens of {t['shape']} (full logits; "
                f"{t['trace_bytes'] / 2**30:.2f} GiB of Parquet, a trace of its own, seed 2, removed after), "
                f"fetch_all + LRU in a process of its own: {parquet:.3f} CPU s from Parquet (all threads), "
                f"{kernel:.3f} CPU s from the trace cache (the calling thread; the cache built first, "
                f"{t['cache_build_s']:.1f} s, not timed), kernel share **{kernel / parquet:.0%}**; medians of "
                f"{len(t['parquet_cpu_s'])} runs each."]
    if "scale" in fig:
        sc, syn = fig["scale"], fig["scale_synth"]
        out += [
            "",
            "## Scale",
            "",
            f"{sc['tokens']:,} tokens of {SCALE_SHAPE.name} shape, top-k only (no logits: "
            "quality_first substitutes by frequency), "
            f"{syn['bytes'] / 2**30:.2f} GiB of Parquet written by the streaming synth in "
            f"{syn['wall_s']:.0f} s on one core while the measurements above ran. Each pass in "
            "one process, peak RSS reset before it; the policies' kernels are loaded on the trace's "
            "first 64 tokens before the first pass (compiled beforehand in another process where "
            "Numba's cache lacks them, so that compilation's memory is not counted):",
            "",
        ]
        rows = [[label, f"{p['wall_s']:.1f}", f"{p['cpu_s']:.1f}",
                 f"{p['lookups'] / p['cpu_s'] / 1e6:.1f}" if "lookups" in p else "",
                 f"{p['peak_rss'] / mib:.0f}", f"{p['hit_rate']:.3f}" if "hit_rate" in p else ""]
                for label, p in sc["passes"].items()]
        out.append(_table(["pass", "wall s", "CPU s", "M lookups/s (CPU, decode included)",
                           "peak RSS MiB", "hit rate"], rows))
    out += ["", "## Targets", ""]
    out.append(_table(["target", "measured", "", "met"],
                      [[t, m, r, "yes" if ok else "**no**"] for t, m, r, ok in _targets(fig)]))
    out += ["", "## Notes on the targets", "", NOTES.format(**_note_figures(fig))]
    return "\n".join(out)


def _note_figures(fig: dict) -> dict:
    """The measured numbers the notes quote."""
    shapes = list(fig["shapes"].values())

    def span(xs, fmt):
        lo, hi = min(xs), max(xs)
        return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{lo:{fmt}}-{hi:{fmt}}"

    fa = [s["policies"]["fetch_all+lru"] for s in shapes]
    qwen = [s["libcachesim"] for s in shapes if s["shape"]["top_k"] > 2]
    ours = [_med(p["ours_cpu_s"]) / lc["requests"] * 1e9 for lc in qwen for p in lc["policies"].values()]
    theirs = [_med(p["lcs_cpu_s"]) / lc["requests"] * 1e9
              for lc in qwen for p in lc["policies"].values()]
    curve = [lc["stream_mrc"]["sizes"] * _med(lc["policies"]["lru"]["lcs_cpu_s"])
             / _med(lc["stream_mrc"]["cpu_s"]) for lc in (s["libcachesim"] for s in shapes)]
    mixtral = min(shapes, key=lambda s: s["shape"]["top_k"])["policies"]["fetch_all+lru"]
    return {
        "fa_ref": span([_med(p["ref_cpu_s"]) / _med(p["ref_numba_cpu_s"]) for p in fa], ".0f") + "x",
        "ours_ns": span(ours, ".0f"), "lcs_ns": span(theirs, ".0f"),
        "need_ns": format(min(theirs) / 10, ".1f"),
        "curve": span(curve, ",.0f") + "x",
        "mx_steps": format(_rate(mixtral["steps"], _med(mixtral["cpu_s"])) / 1e6, ".0f"),
        "mx_lookups": format(_rate(mixtral["lookups"], _med(mixtral["cpu_s"])) / 1e6, ".0f"),
        "yard_ns": format(_med(shapes[0]["yardstick"]["cpu_s"]) / shapes[0]["yardstick"]["lookups"] * 1e9, ".1f"),
        **_minimal_note_figures(shapes[0]["yardstick"]),
        **_baseline_note_figures(fig.get("baseline", {})),
    }


def _baseline_note_figures(b: dict) -> dict:
    """The side-by-side run's figures the notes quote ('n/a' where it did not run)."""
    keys = ("base_speedup", "base_kernel", "base_scaled", "base_ns")
    if "rounds" not in b:
        return dict.fromkeys(keys, "n/a")
    sb = bench_baseline.summary(b)
    kernel = "n/a" if sb["kernel_speedup"] is None else f"{sb['kernel_speedup']:.2f}x"
    return dict(zip(keys, (f"{sb['speedup']:.2f}x", kernel, f"{sb['scaled_ns']:.1f}",
                           f"{sb['baseline_ns']:.1f}"), strict=True))


def _minimal_note_figures(y: dict) -> dict:
    """The minimal kernels' figures the notes quote ('n/a' in figures of earlier versions)."""
    out = {"fa_over": f"{_yardstick_ratio(y):.2f}x"}
    for pre, _ in MINIMAL_KERNELS.values():
        keys = (f"{pre}min", f"{pre}eng", f"{pre}over")
        if f"{pre}cpu_s" not in y:
            out.update(dict.fromkeys(keys, "n/a"))
            continue
        out.update(zip(keys, (f"{_med(y['cpu_s']) / _med(y[f'{pre}cpu_s']):.2f}x",
                              f"{_med(y['engine_cpu_s']) / _med(y[f'{pre}engine_cpu_s']):.2f}x",
                              f"{_rounds_ratio(y[f'{pre}engine_cpu_s'], y[f'{pre}cpu_s']):.2f}x"), strict=True))
    return out


def _fail(message: str) -> NoReturn:
    print(f"moe-bench: error: {message}", file=sys.stderr)
    sys.exit(EXIT_INPUT_ERROR)


def _read_figures(path: str) -> dict:
    """The figures a run wrote with --json; one error line and exit 2 where they cannot be read."""
    try:
        figures = json.loads(Path(path).read_text())
    except OSError as exc:
        _fail(f"--from-json {path}: cannot be read ({exc.strerror or exc}); pass the file `make "
              "bench` wrote (docs/benchmarks.json)")
    except ValueError as exc:
        _fail(f"--from-json {path}: is not JSON ({exc}); pass the file `make bench` wrote")
    if not isinstance(figures, dict):
        _fail(f"--from-json {path}: holds no figures object; pass the file `make bench` wrote")
    return figures


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="moe-bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the Markdown report here (e.g. docs/BENCHMARKS.md)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure (the median is reported)")
    ap.add_argument("--scale-tokens", type=int, default=1_000_000,
                    help="tokens of the large streamed trace (0: skip)")
    ap.add_argument("--token-scale", type=float, default=1.0,
                    help="multiply the per-shape trace sizes (e.g. 0.1 for a quick smoke run)")
    ap.add_argument("--work-dir", help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--json", help="also write the raw figures as JSON here")
    ap.add_argument("--from-json", metavar="PATH",
                    help="measure nothing: render the figures a run wrote with --json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        task = json.loads(args.worker)
        print(json.dumps(WORKERS[task.pop("kind")](task)))
        return
    if args.from_json:
        figures = _read_figures(args.from_json)
    else:
        work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="moe-bench-"))
        work_dir.mkdir(parents=True, exist_ok=True)
        try:
            figures = run_bench(max(1, args.repeats), args.scale_tokens, work_dir, args.token_scale)
        finally:
            if not args.work_dir:
                shutil.rmtree(work_dir, ignore_errors=True)
    try:
        report = render(figures)
    except KeyError as exc:
        _fail(f"{args.from_json or 'the run'}: figures lack {exc}; write them again with "
              "`make bench` (--json) from this version")
    print(report)
    if args.json:
        atomic_write_text(args.json, json.dumps(figures, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, report)


if __name__ == "__main__":
    main()
