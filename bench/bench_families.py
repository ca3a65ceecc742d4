"""CPU speed of every family next to llama.cpp: pp512 and tg128 on each family's 0.5-1B
synthetic geometry at Q4_K_M, same file, same thread count (issue 14, "Speed and memory").

    .venv/bin/python bench/bench_families.py --threads 2 \
        --llama-python /work/llamavenv/bin/python --markdown bench/families.md

For each family the synthetic file (:mod:`localllm.models.synthetic`, random weights of a
real geometry, llama.cpp's per-tensor types of the recipe) is written once into the user
cache directory, as ``localllm bench --synthetic`` does. Then, per round and per family, one
localllm process and one llama.cpp process run ``bench/bench_cpu.py``'s protocol (one
warm-up pass, pp = one batch of ``--n-prompt`` tokens, tg = ``--n-gen`` greedy one-token
steps), alternately, so that a load change on the machine hits both sides alike. Medians over
the rounds are reported (``--stat max``: the best run of each side). On a shared machine each
run first waits (``--max-wait``) until other processes leave ``--threads`` cores idle, and
the cores they kept busy during the run are reported ("other load"): a row run beside other
jobs says little in wall time; ``--clock cpu --threads 1`` counts tok/s per second of the
process's CPU time instead, which other jobs move much less.

"per weight byte": tok/s x the weight bytes a token reads (every matrix of the file at its
stored size, without the input embedding unless it is also the output projection, and for
MoE only the ``expert_used_count`` of ``expert_count`` experts), relative to the ``llama``
family's row. The issue's rule: no family below 0.8 of llama on localllm. Since a geometry's
own shape moves that figure in llama.cpp too (many small layers cost more per byte), each
family's ratio localllm / llama.cpp relative to the llama family's is given as well: below
0.8 there would be a slow path of localllm's own. For the MoE row the per-byte figure
computed with the total expert bytes is given too: tok/s follows the active parameters when
that figure is far above 1 and the ratio to llama.cpp holds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH_CPU = HERE / "bench_cpu.py"

# family (llama.cpp's general.architecture, or a variant of one: VARIANTS) -> geometry
FAMILIES: dict[str, str] = {
    "llama": "llama3.2-1b",
    "mistral": "mistral-1b",
    "qwen2": "qwen2.5-0.5b",
    "qwen3": "qwen3-0.6b",
    "qwen3moe": "qwen3moe-1b",
    "gemma": "gemma-1b",
    "gemma2": "gemma2-1b",
    "gemma3": "gemma3-1b",
    "phi3": "phi3-1b",
    "olmo2": "olmo2-1b",
    "granite": "granite3-1b",
    "mistral3": "ministral3-1b",
    "smollm3": "smollm3-1b",
    "apertus": "apertus-1b",
    "seed_oss": "seed-oss-1b",
    "exaone4": "exaone4-1.2b",
    "hunyuan-dense": "hunyuan-1b",
    "ernie4_5": "ernie4.5-1b",
    "qwen35": "qwen35-0.8b",
    "qwen35moe": "qwen35moe-1b",
    "qwen3next": "qwen3next-1b",
    "llama4": "llama4-1b",
    "gemma4": "gemma4-1b",
    "deepseek2": "deepseek-v3-1b",
    "gpt-oss": "gpt-oss-1b",
    "glm4moe": "glm4moe-1b",
    "falcon-h1": "falcon-h1-0.5b",
    "granitehybrid": "granite4-1b",
    "lfm2": "lfm2-1.2b",
    "mamba2": "mamba2-1.3b",
    "nemotron_h": "nemotron-h-1b",
    "olmoe": "olmoe-1b",
    "phimoe": "phimoe-1b",
    "ernie4_5-moe": "ernie4.5-moe-1b",
    "gemma4-moe": "gemma4-moe-1b",
}
# rows that are a variant of another family's architecture (not a general.architecture name)
VARIANTS = {"gemma4-moe": "gemma4", "mistral": "llama"}
MIN_RELATIVE = 0.8  # the issue's floor, tok/s per weight byte relative to llama


def weight_bytes(path: Path) -> dict:
    """File size and weight bytes read per token (active: MoE experts at used/count; total:
    every expert) of a GGUF, from its tensor table (no weight is read)."""
    from localllm.gguf.file import open_gguf

    f = open_gguf(path)
    md = f.metadata
    arch = md["general.architecture"]
    n_exp = int(md.get(f"{arch}.expert_count", 0) or 0)
    n_used = int(md.get(f"{arch}.expert_used_count", 0) or 0)
    tied = "output.weight" not in f.tensors
    active = total = 0
    for name, t in f.tensors.items():
        if name == "token_embd.weight" and not tied:
            continue  # one row per token
        total += t.n_bytes
        active += t.n_bytes * n_used // n_exp if "_exps." in name and n_exp else t.n_bytes
    return {"file_mb": path.stat().st_size / 1e6, "active_mb": active / 1e6,
            "total_mb": total / 1e6}


def _cpu_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (/proc/stat), or (0, 0)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields) - idle) / hz, sum(fields) / hz


def wait_quiet(threads: int, max_wait: float) -> float:
    """Wait (up to ``max_wait`` s) until other processes leave ``threads`` cores idle, as a
    one-second sample of /proc/stat shows; returns the busy cores of the last sample."""
    n_cpu = os.cpu_count() or 1
    deadline = time.monotonic() + max_wait
    while True:
        b0, t0 = _cpu_busy()
        time.sleep(1.0)
        b1, t1 = _cpu_busy()
        busy = (b1 - b0) / (t1 - t0) * n_cpu if t1 > t0 else 0.0
        if busy <= n_cpu - threads + 0.2 or time.monotonic() > deadline:
            return busy


def run_side(python: str, path: Path, side: str, threads: int, n_prompt: int, n_gen: int,
             timeout: float) -> dict:
    """One process of bench_cpu.py's protocol; its JSON line plus ``other_cores``: the cores
    other processes kept busy meanwhile, on average (machine busy time minus this process's
    CPU time, over its wall time); or {"error": ...}."""
    import resource

    cmd = [python, str(BENCH_CPU), str(path), "--side", side, "--threads", str(threads),
           "--n-prompt", str(n_prompt), "--n-gen", str(n_gen), "--backend", "native"]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    b0, _ = _cpu_busy()
    w0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - w0
    b1, _ = _cpu_busy()
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {p.returncode}: {tail[:200]}"}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    return res | {"other_cores": max(0.0, (b1 - b0 - own) / wall) if b1 > 0 else None}


def _stat(runs: list[dict], field: str, stat: str) -> float | None:
    xs = [r[field] for r in runs if r.get(field) is not None]
    if not xs:
        return None
    return max(xs) if stat == "max" and field in ("pp", "tg") else statistics.median(xs)


def summarize(results: dict, sizes: dict, stat: str = "median") -> dict:
    """Per family: the median (or, ``stat="max"``, the best) tok/s of each side, ratios
    ours/llama.cpp, per-weight-byte figures relative to the llama family, and the ratio
    ours/llama.cpp relative to the llama family's (``norm_*``: a slow path of localllm's own
    in that family, the geometry's effect on both sides cancelled); None where a figure is
    missing."""
    rows = {}
    for fam, sides in results.items():
        row = {"geometry": FAMILIES[fam], **sizes[fam]}
        for side, runs in sides.items():
            for f in ("pp", "tg", "rss_mb", "load_s", "other_cores"):
                row[f"{side}_{f}"] = _stat(runs, f, stat)
            errors = [r["error"] for r in runs if "error" in r]
            if errors:
                row[f"{side}_error"] = errors[-1]
        for f in ("pp", "tg"):
            o, ll = row.get(f"ours_{f}"), row.get(f"llama_{f}")
            row[f"ratio_{f}"] = o / ll if o and ll else None
        rows[fam] = row
    base = rows.get("llama")
    for row in rows.values():
        for f in ("pp", "tg"):
            v, b = row.get(f"ratio_{f}"), base and base.get(f"ratio_{f}")
            row[f"norm_{f}"] = v / b if v and b else None
        for side in ("ours", "llama"):
            for f in ("pp", "tg"):
                v, b = row.get(f"{side}_{f}"), base and base.get(f"{side}_{f}")
                row[f"rel_{side}_{f}"] = (v * row["active_mb"] / (b * base["active_mb"])
                                          if v and b else None)
                row[f"rel_total_{side}_{f}"] = (v * row["total_mb"] / (b * base["active_mb"])
                                                if v and b else None)
    return rows


def _f(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()}"


def markdown(rows: dict, meta: dict) -> str:
    n_p, n_g = meta["n_prompt"], meta["n_gen"]
    stat = "best" if meta.get("stat") == "max" else "median"
    clock = ("tok/s per second of process CPU time (all threads)"
             if meta.get("clock") == "cpu" else "tok/s of wall time")
    out = [(f"Machine: {meta['machine']}; {meta['threads']} threads; {meta['rounds']} round(s), "
           f"{stat} of the rounds; {clock}; localllm backend native, llama.cpp "
           f"{meta.get('llama_version', '—')}; {meta['quant']}; {meta['date']}."), "",
           (f"| family | geometry | file MB | weights MB/token | pp{n_p} localllm | "
           f"pp{n_p} llama.cpp | ratio | tg{n_g} localllm | tg{n_g} llama.cpp | ratio | "
           "per weight byte vs llama, localllm: pp / tg | same, llama.cpp: pp / tg | "
           "ratio vs llama's ratio: pp / tg | other load, cores: localllm / llama.cpp |"),
           ("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
           "| ---: | ---: |")]
    for fam, r in rows.items():
        out.append(
            f"| {fam} | {r['geometry']} | {r['file_mb']:.0f} | {r['active_mb']:.0f} | "
            f"{_f(r.get('ours_pp'), '.1f')} | {_f(r.get('llama_pp'), '.1f')} | "
            f"{_f(r.get('ratio_pp'), '.2f')} | {_f(r.get('ours_tg'), '.2f')} | "
            f"{_f(r.get('llama_tg'), '.2f')} | {_f(r.get('ratio_tg'), '.2f')} | "
            f"{_f(r.get('rel_ours_pp'), '.2f')} / {_f(r.get('rel_ours_tg'), '.2f')} | "
            f"{_f(r.get('rel_llama_pp'), '.2f')} / {_f(r.get('rel_llama_tg'), '.2f')} | "
            f"{_f(r.get('norm_pp'), '.2f')} / {_f(r.get('norm_tg'), '.2f')} | "
            f"{_f(r.get('ours_other_cores'), '.1f')} / {_f(r.get('llama_other_cores'), '.1f')} |")
    out += ["", *checks(rows)]
    errors = [f"- {fam} {side}: {r[side + '_error']}" for fam, r in rows.items()
              for side in ("ours", "llama") if r.get(side + "_error")]
    if errors:
        out += ["", "Failed runs:", *errors]
    return "\n".join(out) + "\n"


def checks(rows: dict) -> list[str]:
    """The issue's two rules, checked on the figures."""
    lines = []
    low = [f"{fam} ({f} {r[f'rel_ours_{f}']:.2f})" for fam, r in rows.items()
           for f in ("pp", "tg") if r.get(f"rel_ours_{f}") is not None
           and r[f"rel_ours_{f}"] < MIN_RELATIVE]
    lines.append(f"Rule \"no family below {MIN_RELATIVE}x of llama's tok/s per weight byte\" "
                 f"(localllm): " + ("holds." if not low else "below: " + ", ".join(low) + "."))
    slow = [f"{fam} ({f} {r[f'norm_{f}']:.2f})" for fam, r in rows.items()
            for f in ("pp", "tg") if r.get(f"norm_{f}") is not None
            and r[f"norm_{f}"] < MIN_RELATIVE]
    lines.append("Against llama.cpp on the same file (the geometry's own cost cancelled): "
                 + ("no family's ratio is below " + f"{MIN_RELATIVE}x llama's."
                    if not slow else "below " + f"{MIN_RELATIVE}x llama's ratio: "
                    + ", ".join(slow) + "."))
    for fam, r in rows.items():
        if r["total_mb"] > r["active_mb"] * 1.05 and r.get("rel_ours_tg") is not None:
            # Active: far faster than its total bytes allow, and per active byte no further
            # from the dense llama than llama.cpp's own figure is.
            follows = r["rel_total_ours_tg"] > 1.5 and (r.get("norm_tg") is None
                                                        or r["norm_tg"] >= MIN_RELATIVE)
            lines.append(
                f"MoE {fam}: tg per weight byte vs llama {r['rel_ours_tg']:.2f} counting the "
                f"{r['active_mb']:.0f} MB a token reads (active experts; llama.cpp "
                f"{_f(r.get('rel_llama_tg'), '.2f')}), {r['rel_total_ours_tg']:.2f} counting "
                f"all {r['total_mb']:.0f} MB: tok/s "
                + ("follows the active parameters." if follows
                   else "does NOT follow the active parameters."))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128, help="tg steps (32 for a quick run)")
    ap.add_argument("--quant", default="Q4_K_M")
    ap.add_argument("--llama-python", help="python with llama_cpp (omit: localllm only)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    ap.add_argument("--max-wait", type=float, default=120.0,
                    help="seconds to wait before each run for other processes to leave "
                         "--threads cores idle")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="tok/s per second of wall time, or of the process's CPU time (all "
                         "threads; steadier beside other jobs, meaningful at --threads 1)")
    ap.add_argument("--stat", choices=["median", "max"], default="median",
                    help="per side, the median or the best tok/s of the rounds (max: the "
                         "least disturbed run, on a machine shared with other jobs)")
    ap.add_argument("--markdown", help="write the table to this file")
    ap.add_argument("--from-json", help="no runs: the table of a --json file written before")
    ap.add_argument("--json", help="write all runs and the summary to this file")
    ap.add_argument("--discard", action="store_true",
                    help="remove each synthetic file this run wrote after its rows")
    ap.add_argument("--write-only", action="store_true",
                    help="only write the families' synthetic files (no runs)")
    a = ap.parse_args()
    if a.threads < 1 or a.rounds < 1 or a.n_prompt < 16 or a.n_gen < 1:
        ap.error("--threads, --rounds and --n-gen must be >= 1, --n-prompt >= 16")

    if a.from_json:
        saved = json.loads(Path(a.from_json).read_text())
        sizes = {fam: {k: r[k] for k in ("file_mb", "active_mb", "total_mb")}
                 for fam, r in saved["rows"].items()}
        table = markdown(summarize(saved["runs"], sizes, saved["meta"].get("stat", "median")),
                         saved["meta"])
        print(table)
        if a.markdown:
            Path(a.markdown).write_text(table)
        return

    from localllm.models.synthetic import cache_path, synthetic_model
    from localllm.quantize.recipe import parse_file_type

    families = ["llama"] + [f for f in a.families if f != "llama"]  # the reference row first
    sides = [("ours", sys.executable)] + ([("llama", a.llama_python)] if a.llama_python else [])
    results: dict = {fam: {s: [] for s, _ in sides} for fam in families}
    sizes: dict = {}
    # One family at a time, its rounds together (sides alternating within each round): the
    # thirty files take about 25 GB, so with --discard each is removed after its rows unless
    # it was in the cache before this run.
    for fam in families:
        t0 = time.perf_counter()
        existed = cache_path(FAMILIES[fam], parse_file_type(a.quant)).exists()
        path = synthetic_model(FAMILIES[fam], a.quant)
        sizes[fam] = weight_bytes(path)
        print(f"{fam:9} {path} ({sizes[fam]['file_mb']:.0f} MB, "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
        for r in range(0 if a.write_only else a.rounds):
            for side, py in (sides if r % 2 == 0 else sides[::-1]):
                busy = wait_quiet(a.threads, a.max_wait)
                if busy > (os.cpu_count() or 1) - a.threads + 0.2:
                    print(f"(other processes keep {busy:.1f} cores busy; running anyway)",
                          flush=True)
                res = run_side(py, path, side, a.threads, a.n_prompt, a.n_gen, a.timeout)
                if a.clock == "cpu" and "pp_cpu" in res:
                    res |= {"pp": res["pp_cpu"], "tg": res["tg_cpu"],
                            "pp_wall": res["pp"], "tg_wall": res["tg"]}
                results[fam][side].append(res)
                name = "localllm" if side == "ours" else "llama.cpp"
                if "error" in res:
                    print(f"round {r} {fam:9} {name:9}: FAILED {res['error']}", flush=True)
                else:
                    print(f"round {r} {fam:9} {name:9}: pp{a.n_prompt} {res['pp']:7.1f} tok/s"
                          f"  tg{a.n_gen} {res['tg']:6.2f} tok/s  load {res['load_s']:.1f} s"
                          f"  ({a.clock})  RSS {res['rss_mb']:.0f} MB  other load "
                          f"{_f(res.get('other_cores'), '.1f')} cores", flush=True)
        if a.discard and not existed:
            path.unlink(missing_ok=True)
    if a.write_only:
        return
    rows = summarize(results, sizes, a.stat)
    versions = [x.get("version") for s in results.values() for x in s.get("llama", [])]
    meta = {"machine": machine(), "threads": a.threads, "rounds": a.rounds,
            "n_prompt": a.n_prompt, "n_gen": a.n_gen, "quant": a.quant, "stat": a.stat,
            "clock": a.clock,
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "llama_version": next((v for v in versions if v), None)}
    table = markdown(rows, meta)
    print("\n" + table)
    if a.markdown:
        Path(a.markdown).write_text(table)
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "runs": results, "rows": rows},
                                           indent=1))


if __name__ == "__main__":
    main()
