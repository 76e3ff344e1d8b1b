#!/usr/bin/env python3
"""Checks the docs against the code where a machine can.

    check_docs.py --constants DOCS_CONSTANTS --ulyssesctl ULYSSESCTL --root REPO

- Numbers the code defines: every client_segment_bytes / ClientSegmentLayout::kTotal value
  in docs/*.md and README.md is the layout's size; the client segment's and the session's
  layout versions in docs/protocol.md's byte diagrams and text are the code's; the defaults in the config table of
  docs/operations.md are DaemonConfig's; the minimum driver docs/operations.md states is
  the Dockerfile's MIN_DRIVER_VERSION.
- ulyssesctl as docs/operations.md uses it: every command named in the section 8 table or
  in a `ulyssesctl ...` example exists, and every flag given to it, or named in section 8,
  is one that `ulyssesctl --help` or `ulyssesctl COMMAND --help` lists.
Standard library only.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

FAILURES: list[str] = []


def fail(what: str) -> None:
    FAILURES.append(what)
    print(f"FAIL {what}")


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def check_numbers(root: str, constants: dict) -> int:
    checked = 0
    size = constants["client_segment_bytes"]
    patterns = [r"client_segment_bytes\"?\s*[:=]\s*(\d+)",
                r"ClientSegmentLayout::kTotal`?\s*\((\d+)\)",
                r"(\d{4,})\s*\+-+\+\s*kTotal"]
    docs = [os.path.join(root, "README.md")] + sorted(
        os.path.join(root, "docs", n) for n in os.listdir(os.path.join(root, "docs"))
        if n.endswith(".md"))
    for path in docs:
        text = read(path)
        for pattern in patterns:
            for m in re.finditer(pattern, text):
                checked += 1
                if int(m.group(1)) != size:
                    fail(f"{os.path.relpath(path, root)}:{line_of(text, m.start())}: client segment "
                         f"of {m.group(1)} bytes; the code's ClientSegmentLayout::kTotal is {size}")
    if checked == 0:
        fail("no mention of client_segment_bytes found in the docs (the check would be vacuous)")

    ops_path = os.path.join(root, "docs", "operations.md")
    ops = read(ops_path)
    for key, value in constants["config_defaults"].items():
        m = re.search(r"^\| `" + re.escape(key) + r"` \| `([^`]*)`", ops, re.M)
        if m is None:
            fail(f"docs/operations.md: the config table has no row for {key}")
            continue
        checked += 1
        shown = m.group(1).strip('"')
        if shown != str(value):
            fail(f"docs/operations.md:{line_of(ops, m.start())}: {key} defaults to {shown!r} in "
                 f"the table, {value!r} in DaemonConfig")

    # The layout versions, where the protocol's byte diagrams and text state them.
    proto_path = os.path.join(root, "docs", "protocol.md")
    proto = read(proto_path)
    layouts = [("client segment", "client_segment_version",
                [r"version \((\d+)\) u32\s*\|\s*12 ring_capacity"]),
               ("session", "session_layout_version",
                [r"version \((\d+)\) u32\s*\|\s*world_size",
                 r"session_layout\.h`, layout version (\d+)"])]
    for name, key, layout_patterns in layouts:
        found = 0
        for path, text in ((proto_path, proto),
                           (os.path.join(root, "docs", "architecture.md"),
                            read(os.path.join(root, "docs", "architecture.md")))):
            for pattern in layout_patterns:
                for m in re.finditer(pattern, text):
                    found += 1
                    if int(m.group(1)) != constants[key]:
                        fail(f"{os.path.relpath(path, root)}:{line_of(text, m.start())}: {name} "
                             f"layout version {m.group(1)}; the code's is {constants[key]}")
        if found == 0:
            fail(f"docs/protocol.md and docs/architecture.md state no {name} layout version "
                 "(the check would be vacuous)")
        checked += found

    dockerfile = read(os.path.join(root, "deploy", "Dockerfile"))
    m = re.search(r"^ARG MIN_DRIVER_VERSION=(\S+)", dockerfile, re.M)
    if m is None:
        fail("deploy/Dockerfile: no ARG MIN_DRIVER_VERSION")
    else:
        checked += 1
        stated = re.findall(r"driver of at least \*\*([0-9.]+)\*\*", ops)
        if stated != [m.group(1)]:
            fail(f"docs/operations.md states the minimum driver as {stated}, the Dockerfile "
                 f"as {m.group(1)}")
    return checked


def help_of(ulyssesctl: str, command: str | None) -> str:
    argv = [ulyssesctl] + ([command] if command else []) + ["--help"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return ""
    return r.stdout


def options_in(help_text: str) -> dict[str, bool]:
    """--flag -> whether it takes a value, from the Options section of a CLI11 help."""
    out: dict[str, bool] = {}
    section = help_text.split("Subcommands:")[0]
    for m in re.finditer(r"^\s+((?:-\w,)?--[\w-]+)(?: ([A-Z]+))?", section, re.M):
        for name in m.group(1).split(","):
            out[name] = m.group(2) is not None
    return out


def check_ulyssesctl(root: str, ulyssesctl: str) -> int:
    checked = 0
    top = help_of(ulyssesctl, None)
    if "Subcommands:" not in top:
        fail(f"{ulyssesctl} --help lists no commands")
        return 0
    commands = re.findall(r"^  ([a-z]+)\s", top.split("Subcommands:")[1], re.M)
    global_opts = options_in(top)
    command_opts = {c: options_in(help_of(ulyssesctl, c)) for c in commands}
    ops = read(os.path.join(root, "docs", "operations.md"))

    # The section 8 table: | `command [options]` | ... |
    section8 = ops.split("## 8. ulyssesctl", 1)[1].split("\n## ", 1)[0]
    for m in re.finditer(r"^\| `([a-z]+)((?: [^`]*)?)` \|", section8, re.M):
        name, rest = m.group(1), m.group(2)
        checked += 1
        if name not in commands:
            fail(f"docs/operations.md section 8 names the command {name!r}, which ulyssesctl "
                 f"does not have ({', '.join(commands)})")
            continue
        for flag in re.findall(r"--[\w-]+", rest):
            checked += 1
            if flag not in command_opts[name] and flag not in global_opts:
                fail(f"docs/operations.md section 8: `{name} {flag}` is not an option of "
                     f"ulyssesctl {name}")

    # Every flag section 8 names in a code span of ulyssesctl's (one that starts with
    # ulyssesctl, a command or a flag; not another program's) exists in ulyssesctl.
    known = set(global_opts) | {f for opts in command_opts.values() for f in opts}
    flags: set[str] = set()
    for span in re.findall(r"`([^`\n]+)`", section8):
        first = span.split()[0]
        if first == "ulyssesctl" or first in commands or first.startswith("-"):
            flags.update(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", span))
    for flag in sorted(flags):
        checked += 1
        if flag not in known:
            fail(f"docs/operations.md section 8 names {flag}, which no ulyssesctl command has")

    # Every `ulyssesctl ...` example (code spans and blocks) in operations.md.
    spans = re.findall(r"`([^`\n]*\bulyssesctl [^`\n]*)`", ops)
    spans += re.findall(r"^(?:.*?[;|]\s*|\s*)(ulyssesctl [^\n#]*)", "\n".join(
        block for block in re.findall(r"```(?:sh)?\n(.*?)```", ops, re.S)), re.M)
    for span in spans:
        words = span[span.index("ulyssesctl") + len("ulyssesctl"):].split()
        command, i = None, 0
        while i < len(words):
            w = words[i].rstrip(";)")
            if w.startswith("-"):
                name = w.split("=")[0]
                opts = command_opts.get(command, {}) if command else {}
                if name not in global_opts and name not in opts:
                    fail(f"docs/operations.md: `{span.strip()}`: {name} is not an option of "
                         f"ulyssesctl{' ' + command if command else ''}")
                takes = global_opts.get(name, opts.get(name, False))
                i += 2 if takes and "=" not in w else 1
                checked += 1
                continue
            if command is None and re.fullmatch(r"[a-z]+", w):
                command = w
                checked += 1
                if w not in commands:
                    fail(f"docs/operations.md: `{span.strip()}`: {w!r} is not a ulyssesctl "
                         f"command")
                    break
            elif command is None:
                break  # a placeholder such as COMMAND or [OPTIONS]: the synopsis
            i += 1
    return checked


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--constants", required=True)
    ap.add_argument("--ulyssesctl", required=True)
    ap.add_argument("--root", required=True)
    args = ap.parse_args()
    constants = json.loads(subprocess.run([args.constants], capture_output=True, text=True,
                                          check=True, timeout=30).stdout)
    numbers = check_numbers(args.root, constants)
    ctl = check_ulyssesctl(args.root, args.ulyssesctl)
    print(f"check_docs: {numbers} numbers and {ctl} ulyssesctl mentions checked, "
          f"{len(FAILURES)} failure(s)")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
