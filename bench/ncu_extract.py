#!/usr/bin/env python3
"""Extracts the counters that place the fused epilogue's time from Nsight Compute raw pages.

Usage: ncu_extract.py OUT.json HIDDEN=RAW.csv [HIDDEN=RAW.csv ...] [--commit C] [--date D]

Each RAW.csv is `ncu -i REPORT --page raw --csv` of a `ulysses-fused-bench` run profiled with
`--kernel-name regex:device_kernel`: the epilogue GEMM's launches, with its epilogue (it runs
shared-memory stores) or skipped (the GEMM alone, none). One row per launch.
"""
import argparse
import csv
import json

METRICS = {
    "duration_us": "gpu__time_duration.sum",
    "sm_clock_ghz": "gpc__cycles_elapsed.avg.per_second",
    "tensor_pipe_active_pct_of_elapsed":
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "issue_active_pct_of_elapsed": "sm__inst_issued.avg.pct_of_peak_sustained_elapsed",
    "alu_pipe_pct_of_active": "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "fma_pipe_pct_of_active": "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "xu_pipe_pct_of_active": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "lsu_pipe_pct_of_active": "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",
    "l2_sectors_pct_of_elapsed": "lts__t_sectors.avg.pct_of_peak_sustained_elapsed",
    "shared_store_instructions": "smsp__sass_inst_executed_op_shared_st.sum",
    "shared_store_bank_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "global_load_sectors": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "global_load_sectors_l1_hit": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld_lookup_hit.sum",
    "global_store_sectors": "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
    "stall_long_scoreboard": "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "stall_short_scoreboard":
        "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio",
    "stall_dispatch": "smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio",
    "stall_wait": "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
    "stall_barrier": "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "stall_gmma": "smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio",
    "stall_mio_throttle": "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio",
}
SCALE = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}  # to microseconds


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def launches(hidden, path):
    rows = list(csv.reader(open(path, newline="")))
    header, units, data = rows[0], rows[1], rows[2:]
    at = {name: i for i, name in enumerate(header)}
    for launch, values in enumerate(data, start=1):
        row = {"hidden": hidden, "launch": launch}
        for name, metric in METRICS.items():
            i = at.get(metric)
            row[name] = number(values[i]) if i is not None else None
        unit = units[at[METRICS["duration_us"]]]
        if row["duration_us"] is not None:
            row["duration_us"] *= SCALE.get(unit, 1.0)
        row["variant"] = "epilogue" if (row["shared_store_instructions"] or 0) > 0 else "gemm_alone"
        yield row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("raw", nargs="+", help="HIDDEN=RAW.csv")
    ap.add_argument("--commit", default="")
    ap.add_argument("--date", default="")
    ap.add_argument("--gpu", default="NVIDIA H200")
    ap.add_argument("--bench", default="")
    args = ap.parse_args()
    report = {"gpu": args.gpu, "commit": args.commit, "date": args.date, "mps": False,
              "bench": args.bench, "metrics": METRICS, "rows": []}
    for item in args.raw:
        hidden, path = item.split("=", 1)
        report["rows"].extend(launches(int(hidden), path))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("%6s %6s %-10s %9s %6s %7s %6s %6s %6s" % ("hidden", "launch", "variant", "us", "GHz",
                                                     "tensor", "issue", "xu", "L2"))
    for r in report["rows"]:
        print("%6d %6d %-10s %9.1f %6.2f %6.1f%% %5.1f%% %5.1f%% %5.1f%%" % (
            r["hidden"], r["launch"], r["variant"], r["duration_us"], r["sm_clock_ghz"] or 0,
            r["tensor_pipe_active_pct_of_elapsed"] or 0, r["issue_active_pct_of_elapsed"] or 0,
            r["xu_pipe_pct_of_active"] or 0, r["l2_sectors_pct_of_elapsed"] or 0))


if __name__ == "__main__":
    main()
