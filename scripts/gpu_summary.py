#!/usr/bin/env python3
"""Folds what scripts/gpu_check.sh left in $OUT into one summary.json and one summary.txt.

Reads $OUT/steps/<n>-<name>.{rc,seconds,note} (one entry per step the check ran or skipped),
$OUT/machine.json, the gtest JSON reports in $OUT/tests/, $OUT/generate/*.json (greedy tokens
of a GPU run against the cpu) and the benchmarks' JSON in $OUT/bench/. It runs after every
step, so a check stopped at any point still leaves a summary of what it did.
"""
import json
import pathlib
import sys


def read(path, default=None):
    try:
        return path.read_text().strip()
    except OSError:
        return default


def load_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def steps(out):
    result = []
    for rc_path in sorted((out / "steps").glob("*.rc")):
        stem = rc_path.with_suffix("")
        name = stem.name.split("-", 1)[1] if "-" in stem.name else stem.name
        rc = read(rc_path)
        result.append({
            "step": name,
            "rc": int(rc) if rc and rc.lstrip("-").isdigit() else rc,
            "seconds": float(read(stem.with_suffix(".seconds"), "0") or 0),
            "note": read(stem.with_suffix(".note"), ""),
        })
    return result


def tests(out):
    result = []
    for path in sorted((out / "tests").glob("*.json")):
        report = load_json(path)
        entry = {"binary": path.stem}
        if report is None:
            entry["error"] = "no report (crashed or timed out: see its .log)"
            result.append(entry)
            continue
        passed = failed = skipped = 0
        failures = []
        for suite in report.get("testsuites", []):
            for case in suite.get("testsuite", []):
                name = suite.get("name", "") + "." + case.get("name", "")
                if case.get("result") == "SKIPPED" or case.get("status") == "NOTRUN":
                    skipped += 1
                elif case.get("failures"):
                    failed += 1
                    failures.append({
                        "test": name,
                        "message": case["failures"][0].get("failure", "")[:2000],
                    })
                else:
                    passed += 1
        entry.update(passed=passed, failed=failed, skipped=skipped, failures=failures,
                     seconds=report.get("time"))
        result.append(entry)
    return result


def main():
    out = pathlib.Path(sys.argv[1])
    summary = {
        "machine": load_json(out / "machine.json"),
        "steps": steps(out),
        "tests": tests(out),
        "generate": [load_json(p) for p in sorted((out / "generate").glob("*.json"))],
        "bench": {p.stem: load_json(p) for p in sorted((out / "bench").glob("*.json"))},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    lines = []
    machine = summary["machine"] or {}
    lines.append("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
    lines.append("")
    lines.append("steps:")
    for s in summary["steps"]:
        note = f"  ({s['note']})" if s["note"] else ""
        lines.append(f"  {s['step']:<28} rc={s['rc']!s:<4} {s['seconds']:7.1f} s{note}")
    lines.append("")
    lines.append("tests (passed / failed / skipped):")
    for t in summary["tests"]:
        if "error" in t:
            lines.append(f"  {t['binary']:<40} {t['error']}")
            continue
        lines.append(f"  {t['binary']:<40} {t['passed']:3d} / {t['failed']:3d} / {t['skipped']:3d}")
        for f in t["failures"][:5]:
            first = f["message"].splitlines()[0] if f["message"] else ""
            lines.append(f"      FAILED {f['test']}: {first[:160]}")
    lines.append("")
    lines.append("greedy tokens, GPU against cpu:")
    for g in summary["generate"]:
        if g:
            diff = g.get("max_logprob_diff")
            diff_text = f", max |logprob diff| {diff:.2e}" if isinstance(diff, float) else ""
            lines.append(f"  {g.get('family', '?'):<12} {g.get('variant', ''):<48} "
                         f"{'SAME' if g.get('same') else 'DIFFERENT'}{diff_text}")
    lines.append("")
    quant = summary["bench"].get("quant_cuda")
    if quant:
        lines.append(f"4-bit GEMV on {quant.get('device')}: HBM copy traffic "
                     f"{quant.get('hbm_copy_traffic_gbs', 0):.0f} GB/s")
        for r in quant.get("rows", []):
            lines.append(f"  {r['dtype']:<9} {r['n']:>5}x{r['k']:<5} {r['kernel']:<11} m={r['m']} "
                         f"{r['us']:8.2f} us {r['gbs']:7.0f} GB/s  of copy {r['of_copy']:.2f}  "
                         f"of HBM {r['of_hbm']:.2f}")
    for name in ("decode_gpu", "decode_gemv", "decode_sampled", "decode_profile",
                 "decode_profile_nf4", "decode_int8", "decode_mixtral"):
        decode = summary["bench"].get(name)
        if not decode:
            continue
        lines.append(f"decode on GPU 0 ({name}): copy traffic "
                     f"{decode.get('copy_traffic_gbs', 0):.0f} GB/s")
        for g in decode.get("gemv_shapes", []):
            lines.append(f"  bfloat16 {g['n']:>6}x{g['k']:<6} rows {g['rows']}: decode GEMV "
                         f"{g['decode_gemv_us']:7.2f} us ({g['decode_gemv_of_copy']:.2f} of copy), "
                         f"cuBLAS {g['cublas_us']:7.2f} us ({g['cublas_of_copy']:.2f})")
        for m in decode.get("models", []):
            lines.append(f"  {m['quantize']}: {m['bytes_per_step'] / 1e9:.2f} GB a step, loaded in "
                         f"{m['load_s']:.1f} s, TTFT ({decode.get('prompt')} tokens) "
                         f"{1e3 * m['ttft_s']:.1f} ms")
            for d in m.get("decode", []):
                if d.get("arriving_prompt"):
                    lines.append(f"    batch {d['batch']:>3} + a {d['arriving_prompt']}-token "
                                 f"prompt a step: {d['step_ms']:.2f} ms a step (decodes alone "
                                 f"{d['decode_only_step_ms']:.2f} ms)")
                    continue
                if d.get("general_forward"):
                    lines.append(f"    batch {d['batch']:>3}, general forward: "
                                 f"{d['tokens_per_s']:9.1f} tokens/s")
                    continue
                lines.append(f"    batch {d['batch']:>3}: {d['tokens_per_s']:9.1f} tokens/s, "
                             f"{d['step_ms']:.2f} ms a step, {d['weight_gbs']:.0f} GB/s = "
                             f"{d['of_copy_traffic']:.2f} of copy traffic")
            for g in m.get("graphs", []):
                lines.append(f"    batch {g['batch']:>3}, CUDA graphs: "
                             f"{g['graphs_tokens_per_s']:9.1f} tokens/s against "
                             f"{g['eager_tokens_per_s']:9.1f} eager; tokens "
                             f"{'the same' if g['same_tokens'] else 'DIFFERENT'}")
                if "graphs_unfused_tokens_per_s" in g:
                    lines.append(f"    batch {g['batch']:>3}, CUDA graphs without the fused "
                                 f"kernels: {g['graphs_unfused_tokens_per_s']:9.1f} tokens/s")
                if "graphs_cublas_tokens_per_s" in g:
                    lines.append(f"    batch {g['batch']:>3}, CUDA graphs with cuBLAS and "
                                 f"separate norms: {g['graphs_cublas_tokens_per_s']:9.1f} tokens/s")
            for p in m.get("profiles", []):
                arriving = p.get("arriving_prompt") or 0
                with_prompt = f" + a {arriving}-token prompt" if arriving else ""
                lines.append(f"    profile, batch {p['batch']}{with_prompt}, "
                             f"{'CUDA graphs' if p['graphs'] else 'eager'}: "
                             f"{p['kernels_per_step']:.1f} kernels a step, device busy "
                             f"{p['busy_ms_per_step']:.2f} ms of {p['step_ms']:.2f} ms")
                for k in p.get("top", [])[:12]:
                    lines.append(f"      {k['per_step']:6.1f} a step {k['us_per_step']:8.1f} us  "
                                 f"{k['name'][:80]}")
            for w in m.get("host_waits", []):
                lines.append(f"    batch {w['batch']:>3}, {w['steps']}: the host waits for the "
                             f"device {w['waits_per_step']:.2f} times a step")
    kv = summary["bench"].get("kv_sizing")
    if kv:
        lines.append(f"--gpu_memory_utilization on GPU 0 (nvidia-smi free, total MiB before: "
                     f"{kv.get('free_and_total_mib_before')}):")
        for u in ("0.5", "0.9"):
            got = kv.get(u) or {}
            text = (f"{got.get('blocks')} blocks: {got.get('sizing')}" if "blocks" in got
                    else f"failed: {str(got.get('error', ''))[-300:]}")
            lines.append(f"  {u}: {text}")
    for log in sorted((out / "logs").glob("*-bench_offload.log")):
        for line in (read(log, "") or "").splitlines():
            if "of the bound" in line:
                lines.append(f"offload: {line.strip()}")
    for log in sorted((out / "logs").glob("*-bench_serve_8b*.log")):
        # accel-bench-serve's table: the phases' tokens/s, TTFT and ITL.
        lines.append("accel-serve with streaming gRPC clients, 8B-shaped bfloat16:")
        lines.extend("  " + line for line in (read(log, "") or "").splitlines()[-24:])
    make = summary["bench"].get("make_model")
    if make:
        lines.append(f"accel-make-model, 8B-shaped bfloat16 Llama: {make.get('seconds')} s "
                     f"into {make.get('dir')}")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
