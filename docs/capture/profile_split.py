"""Split py-spy's raw samples of recording_profile.py by pass and by what the capture loop called.

Per pass (the forward alone, recording, capture): the model's thread's samples per pass, in ms
at the sampling rate; within the recording and capture passes, the samples under each call of the
capture loop (the model's forward, the hooks' take, the NLL, the hand-on and what it calls, ...);
and the frames whose own samples (the leaf, native or Python) grew most inside the model's
forward from the forward alone to each pass, per pass.

    python docs/capture/profile_split.py DIR/profile.txt --rate 1000 --passes 5 [--json OUT]

(the raw file may be gzipped: ``.gz``).

``--passes``: how often each pass ran (the rounds, plus one untimed run each).
"""
import argparse
import collections
import gzip
import json
import re

PASSES = {"pass_forward_alone": "forward", "pass_recording": "recording", "pass_capture": "capture"}
LOOPS = ("teacher_forced",)
FORWARD = "Module._wrapped_call_impl"
HOOK = "RouterRecorder._hook.<locals>.hook"


def name(frame: str) -> str:
    """``func (file:line)`` -> ``func``; a native frame ``0x... (lib)`` -> ``lib``."""
    func = frame.split(" (", 1)[0]
    if re.fullmatch(r"0x[0-9a-f]+", func):
        return frame.split(" (", 1)[1].rstrip(")")
    return func[:100]  # C++ templates run to kilobytes


def split(lines, main: str = "MainThread") -> dict:
    per_pass = collections.Counter()
    calls = {p: collections.Counter() for p in PASSES.values()}
    leaves = {p: collections.Counter() for p in PASSES.values()}
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        if not frames or main not in frames[0]:
            continue
        names = [name(f) for f in frames[1:]]
        where = next((PASSES[n] for n in names if n in PASSES), None)
        if where is None:
            continue
        n = int(count)
        per_pass[where] += n
        loop = next((i for i, f in enumerate(names) if f in LOOPS), None)
        inside = names[loop + 1:] if loop is not None else []
        if where == "forward":
            inside = names[names.index("forward") + 1:] if "forward" in names else []
        if not inside:
            calls[where]["(outside the loop: setup, the writer's open and close)"] += n
            continue
        head = inside[0]
        if head == FORWARD:
            label = "the model's forward: router hooks" if HOOK in inside else "the model's forward"
            if HOOK not in inside:
                leaves[where][inside[-1]] += n
        elif head == "_hand_on" and len(inside) > 1:
            label = f"_hand_on > {inside[1]}" + (f" > {inside[2]}" if len(inside) > 2 and inside[1] in
                                                  ("_Drain.put", "_routing_parts") else "")
        else:
            label = head
        calls[where][label] += n
    return {"per_pass": per_pass, "calls": calls, "leaves": leaves}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw")
    p.add_argument("--rate", type=float, default=1000.0, help="py-spy's samples per second")
    p.add_argument("--passes", type=int, required=True, help="runs of each pass (rounds + 1)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json")
    args = p.parse_args()
    if args.rate <= 0 or args.passes < 1:
        p.error(f"--rate {args.rate} and --passes {args.passes}: give a rate > 0 and at least one pass")
    try:
        with (gzip.open(args.raw, "rt") if args.raw.endswith(".gz") else open(args.raw)) as f:
            got = split(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SystemExit(f"profile_split: {args.raw} is not py-spy's raw output ({e}); "
                         "record with `py-spy record -f raw`") from None
    if not got["per_pass"]:
        raise SystemExit(f"profile_split: {args.raw} holds no samples of recording_profile.py's passes on "
                         "MainThread; record it with `py-spy record --threads -f raw`")
    ms = 1e3 / args.rate / args.passes  # one sample, in ms per pass
    out = {"ms_per_pass": {k: round(v * ms, 1) for k, v in got["per_pass"].items()}}
    for where in ("recording", "capture", "forward"):
        out[f"{where}: calls, ms per pass"] = {k: round(v * ms, 1) for k, v in got["calls"][where].most_common()}
    base = got["leaves"]["forward"]
    for where in ("recording", "capture"):
        grown = {k: v - base.get(k, 0) for k, v in got["leaves"][where].items()}
        out[f"{where}: the forward's leaves grown over the forward alone, ms per pass"] = {
            k: round(v * ms, 1) for k, v in sorted(grown.items(), key=lambda kv: -kv[1])[:args.top]}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
