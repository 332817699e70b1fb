"""Structured config of the moe-capture app: every field with its help text.

Plain dataclasses, so the capture runs without Hydra (``traces.capture.capture.run_capture``
takes a :class:`CaptureConfig`); ``traces.capture.app`` registers them with Hydra.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    path: str | None = None  # local Hugging Face checkpoint directory (config, weights, tokenizer)
    config: str | None = None  # or: a config.json to build a randomly initialised model from
    tokenizer: str | None = None  # tokenizer directory; null = model.path (or the config's folder)
    name: str | None = None  # model name written to the trace; null = the folder name
    dtype: str = "auto"  # auto (checkpoint dtype; bfloat16 for model.config) | bfloat16 | float16 | float32
    device: str = "auto"  # auto (cuda when available) | cuda | cuda:N | cpu
    seed: int = 0  # seed of the random initialisation (model.config) and of sampling
    attn_implementation: str | None = None  # null = the transformers default (sdpa)


@dataclass
class InputConfig:
    paths: list[str] = field(default_factory=list)  # files, folders (recursive) and .jsonl files
    text_field: str = "text"  # JSONL: field holding the text
    domain_field: str = "domain"  # JSONL: field holding the domain label
    domain: str | None = None  # domain of plain files; null = the folder they were found under
    window_tokens: int = 512  # tokens per window (one trace sequence), BOS included
    min_window_tokens: int = 16  # drop shorter document tails
    max_tokens: int | None = None  # stop after this many input tokens; null = all
    add_bos: bool = True  # start every window with the tokenizer's BOS token, if it has one


@dataclass
class GenerateConfig:
    prompt_tokens: int = 64  # mode=generate: tokens of each window used as the prompt (prefill)
    new_tokens: int = 64  # mode=generate: decode steps per sequence (each fed token is recorded)
    temperature: float = 0.0  # 0 = greedy; else sample from softmax(logits / temperature)


@dataclass
class LookaheadConfig:
    enabled: bool = False  # record look-ahead routing: at MoE layer l, the routers of layers l+1..l+depth
    depth: int = 1  # D: how many MoE layers ahead (1 .. MoE layers - 1)
    # hidden state of layer l the routers ahead see: moe_input (layer l's MoE-block input, the router's
    # own input: the "stale gate") | layer_output (decoder layer l's output, i.e. the next layer's
    # pre-attention input, through layer l+d's post-attention norm); traces/capture/hooks.py
    source: str = "moe_input"
    logits: str = "top:32"  # top:R (the R highest per layer ahead, with ids; all E when R >= E) | full


WRITERS = ("processes", "threads", "dispatcher")  # CaptureConfig.writer
RECORDING_STREAMS = ("side", "main")  # CaptureConfig.recording_stream


@dataclass
class CaptureConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    input: InputConfig = field(default_factory=InputConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    out: str = "outputs/capture.parquet"  # trace file to write
    force: bool = False  # overwrite an existing trace file
    mode: str = "teacher_forced"  # teacher_forced (windows, batched) | generate (KV-cache decode)
    # router logits stored: top:R (the R highest, with ids; all E when R >= E) | full | none
    logits: str = "top:64"
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    batch_size: int = 16  # windows per forward (teacher_forced) or sequences decoded together
    writers: int = 0  # encoders of the trace's row groups, in parallel; 0 = half the CPU cores, at most 8
    # dispatcher (the whole writer, encoders included, in a child process: one message per forward;
    # traces/capture/dispatch.py) | processes (encoders in child processes, handed each unit by
    # threads of this process) | threads (encoders in this process)
    writer: str = "dispatcher"
    # tokens per row group the writer encodes at a time; 0 = auto (one forward's tokens, within ~1 to ~8 MiB of rows)
    unit_tokens: int = 0
    # on a GPU host with >= 4 CPUs: the thread that drives the model on a CPU core of its own, the
    # writer's threads and processes on the others (traces.capture.cores). Off by default: a model
    # with layers offloaded to the CPU would run them on that one core
    pin_threads: bool = False
    # rows go from the device straight into shared memory that the encoder processes read in place
    # (registered with CUDA once per slab); false: through torch's pinned buffers, copied once more.
    # The shared-memory files go in /dev/shm, or in the folder $MOE_TRACE_SHARED_DIR names (one of
    # this host's own: files of process ids not running here are swept as those of dead captures)
    shared_rows: bool = True
    # where the recording's own device work runs (the top-R selection, the NLL; generate mode's stacking):
    # side (a stream of its own, beside the next forward) | main (the model's stream, ahead of the
    # next forward). Same rows either way; side keeps that work off a forward that waits for its
    # stream (e.g. when it copies its inputs from pageable memory)
    recording_stream: str = "side"
    # the top-R logits selected by one Triton kernel on a GPU with Triton (traces/capture/top_r.py);
    # false, or where it cannot run: two stable sorts. The same rows either way
    top_r_kernel: bool = True
    # with top_r_kernel, top-R logits and no look-ahead: each block's stored routing columns (the
    # top R with their ids, the experts as int16, the weights as float32) written by one Triton
    # kernel straight into the trace writer's shared memory (traces/capture/top_r.py), instead of
    # casts, the top-R kernel and a copy per column, each a launch on the thread that drives the
    # model. The same rows either way. Off by default: on an H100 host it made the recording alone
    # 0.98-1.00x as long, round by round, and the capture 0.96-1.01x, within that host's noise
    # (docs/CAPTURE.md, runs 1207ai and 1207aj)
    rows_kernel: bool = False
    # teacher_forced: the recording holds the routing of consecutive forwards up to this many
    # tokens (and RECORD_BLOCK_BYTES of device memory, traces/capture/capture.py), then stacks it,
    # selects the stored forms and hands the rows on in one go: its host work per forward (a few
    # dozen launches, on the thread that drives the model) is paid once per block. Blocks shrink
    # towards the end; the last forward goes alone. 0: every forward on its own. The same rows
    # either way. The default holds forwards of up to 4,096 tokens (batch 1 to 8 of 512-token
    # windows): at batch 1 the small Qwen3-Next shape captured 2.3 % faster with blocks (16 of 20
    # rounds); at batch 16, blocks of four 8,192-token forwards made the recording 2.3 % slower
    # (6 of 6 rounds; docs/CAPTURE.md, runs 1206p and 1206q)
    record_block_tokens: int = 8192
    prefill_tokens: int = 0  # teacher_forced: first N tokens of each window recorded as prefill
    progress: bool | None = None  # progress bar with tokens/s; null = only on a terminal
