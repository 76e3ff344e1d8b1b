#!/usr/bin/env python3
"""Lints a Dockerfile for the rules deploy/Dockerfile must keep (no build: a static check).

    lint_dockerfile.py DOCKERFILE     exit 0 when every rule holds, else 1 with one line per problem
    lint_dockerfile.py --self-test    checks that each rule catches a Dockerfile breaking it

Rules:
  multi-stage        at least two FROM instructions
  non-root           the final stage has a USER instruction, and its last one is not root/0
  healthcheck        the final stage has a HEALTHCHECK that is not NONE
  pinned-base        no base image with the tag `latest` or without a tag (a digest is fine);
                     global ARG defaults are substituted first; FROM <earlier stage> is fine
  copy-from-stage    every COPY --from names a stage defined earlier with FROM ... AS name
  apt                every RUN with `apt-get install` passes --no-install-recommends and removes
                     /var/lib/apt/lists in the same RUN; every `apt-get update` is in a RUN that
                     also installs
"""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field


@dataclass
class Instruction:
    line: int  # 1-based line of the instruction's first line
    keyword: str  # upper case
    args: str  # the rest, continuation lines joined


@dataclass
class Stage:
    index: int
    name: str | None
    image: str
    line: int
    instructions: list[Instruction] = field(default_factory=list)


def parse(text: str) -> list[Instruction]:
    """Splits a Dockerfile into instructions (comments dropped, `\\` continuations joined)."""
    escape = "\\"
    lines = text.splitlines()
    # Parser directives: only at the very top, `# escape=` may change the escape character.
    for raw in lines:
        m = re.match(r"^#\s*([a-zA-Z]+)\s*=\s*(\S+)\s*$", raw)
        if not m:
            break
        if m.group(1).lower() == "escape":
            escape = m.group(2)
    out: list[Instruction] = []
    buf: list[str] = []
    start = 0
    for number, raw in enumerate(lines, 1):
        stripped = raw.strip()
        if not buf:
            if not stripped or stripped.startswith("#"):
                continue
            start = number
        elif stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped
        if stripped.endswith(escape):
            buf.append(stripped[: -len(escape)].rstrip())
            continue
        buf.append(stripped)
        joined = " ".join(part for part in buf if part)
        buf = []
        keyword, _, args = joined.partition(" ")
        out.append(Instruction(start, keyword.upper(), args.strip()))
    if buf:
        joined = " ".join(part for part in buf if part)
        keyword, _, args = joined.partition(" ")
        out.append(Instruction(start, keyword.upper(), args.strip()))
    return out


def substitute(value: str, args: dict[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return args.get(name, "")

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::[-+][^}]*)?\}|\$([A-Za-z_][A-Za-z0-9_]*)", repl, value)


def split_flags(args: str) -> tuple[dict[str, str], list[str]]:
    """`--from=build --chown=a:b src dst` -> ({'from': 'build', 'chown': 'a:b'}, ['src', 'dst'])."""
    try:
        words = shlex.split(args, posix=True)
    except ValueError:
        words = args.split()
    flags: dict[str, str] = {}
    rest: list[str] = []
    for w in words:
        if not rest and w.startswith("--"):
            key, _, value = w[2:].partition("=")
            flags[key.lower()] = value
        else:
            rest.append(w)
    return flags, rest


def stages_of(instructions: list[Instruction]) -> tuple[list[Stage], dict[str, str]]:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "ARG" and not stages:
            name, _, default = ins.args.partition("=")
            global_args[name.strip()] = default.strip().strip('"').strip("'")
        elif ins.keyword == "FROM":
            flags, rest = split_flags(ins.args)
            image = rest[0] if rest else ""
            name = rest[2] if len(rest) >= 3 and rest[1].upper() == "AS" else None
            stages.append(Stage(len(stages), name, image, ins.line))
        elif stages:
            stages[-1].instructions.append(ins)
    return stages, global_args


def image_tag(image: str) -> tuple[str | None, bool]:
    """(tag, has_digest) of an image reference."""
    if "@" in image:
        return None, True
    last = image.rsplit("/", 1)[-1]
    if ":" in last:
        return last.split(":", 1)[1], False
    return None, False


def lint(text: str) -> list[str]:
    problems: list[str] = []
    instructions = parse(text)
    stages, global_args = stages_of(instructions)

    if len(stages) < 2:
        problems.append(f"multi-stage: {len(stages)} FROM instruction(s), need at least 2")

    names: set[str] = set()
    for stage in stages:
        image = substitute(stage.image, global_args)
        if image.lower() in names:
            pass  # FROM an earlier stage
        elif image.lower() == "scratch":
            pass
        else:
            tag, digest = image_tag(image)
            if not digest and tag is None:
                problems.append(f"pinned-base: line {stage.line}: {image!r} has no tag (means latest)")
            elif tag == "latest":
                problems.append(f"pinned-base: line {stage.line}: {image!r} uses the latest tag")
            elif tag is not None and (tag == "" or "$" in tag):
                problems.append(f"pinned-base: line {stage.line}: {image!r}: tag has an unset ARG")
        for ins in stage.instructions:
            if ins.keyword in ("COPY", "ADD"):
                flags, _ = split_flags(ins.args)
                if "from" in flags:
                    source = flags["from"]
                    if ins.keyword == "ADD":
                        problems.append(f"copy-from-stage: line {ins.line}: ADD has no --from")
                    elif source.lower() not in names:
                        problems.append(
                            f"copy-from-stage: line {ins.line}: COPY --from={source} is not a stage "
                            f"named earlier (named: {', '.join(sorted(names)) or 'none'})")
            if ins.keyword == "RUN":
                cmd = ins.args
                if re.search(r"\bapt-get\b[^;&|]*\binstall\b", cmd):
                    if "--no-install-recommends" not in cmd:
                        problems.append(f"apt: line {ins.line}: apt-get install without --no-install-recommends")
                    if not re.search(r"rm\s+(-[a-zA-Z]+\s+)*/var/lib/apt/lists", cmd):
                        problems.append(f"apt: line {ins.line}: apt-get install without rm -rf /var/lib/apt/lists/*")
                if re.search(r"\bapt-get\b[^;&|]*\bupdate\b", cmd) and not re.search(
                        r"\bapt-get\b[^;&|]*\binstall\b", cmd):
                    problems.append(f"apt: line {ins.line}: apt-get update in a RUN that installs nothing")
        if stage.name:
            names.add(stage.name.lower())

    if stages:
        final = stages[-1]
        users = [ins for ins in final.instructions if ins.keyword == "USER"]
        if not users:
            problems.append("non-root: the final stage has no USER instruction (runs as root)")
        else:
            user = substitute(users[-1].args, global_args).split(":", 1)[0].strip()
            if user in ("", "root", "0"):
                problems.append(f"non-root: line {users[-1].line}: the final stage runs as {user or 'root'!r}")
        checks = [ins for ins in final.instructions if ins.keyword == "HEALTHCHECK"]
        if not checks:
            problems.append("healthcheck: the final stage has no HEALTHCHECK")
        elif checks[-1].args.strip().upper() == "NONE":
            problems.append(f"healthcheck: line {checks[-1].line}: HEALTHCHECK NONE")
    return problems


GOOD = """\
# syntax=docker/dockerfile:1
ARG V=1.0
FROM debian:12 AS build
RUN apt-get update \\
 && apt-get install -y --no-install-recommends gcc \\
 && rm -rf /var/lib/apt/lists/*
FROM example/runtime:${V} AS runtime
COPY --from=build /out /out
USER app
HEALTHCHECK CMD ["true"]
"""

# (rule that must fire, Dockerfile breaking it)
BAD = [
    ("multi-stage", "FROM debian:12\nUSER app\nHEALTHCHECK CMD true\n"),
    ("non-root", GOOD.replace("USER app", "USER root")),
    ("non-root", GOOD.replace("USER app", "USER 0:0")),
    ("non-root", GOOD.replace("USER app\n", "")),
    ("healthcheck", GOOD.replace('HEALTHCHECK CMD ["true"]\n', "")),
    ("healthcheck", GOOD.replace('HEALTHCHECK CMD ["true"]', "HEALTHCHECK NONE")),
    ("pinned-base", GOOD.replace("debian:12", "debian:latest")),
    ("pinned-base", GOOD.replace("debian:12", "debian")),
    ("pinned-base", GOOD.replace("ARG V=1.0", "ARG V=latest")),
    ("copy-from-stage", GOOD.replace("--from=build", "--from=builder")),
    ("copy-from-stage", GOOD.replace("--from=build", "--from=0")),
    ("copy-from-stage", GOOD.replace("--from=build", "--from=nginx:1.25")),
    ("apt", GOOD.replace(" --no-install-recommends", "")),
    ("apt", GOOD.replace(" \\\n && rm -rf /var/lib/apt/lists/*", "")),
    ("apt", GOOD + "RUN apt-get update\n"),
]


def self_test() -> int:
    failures = 0
    if lint(GOOD):
        print(f"self-test: the good Dockerfile was flagged: {lint(GOOD)}")
        failures += 1
    for rule, text in BAD:
        found = lint(text)
        if not any(p.startswith(rule + ":") for p in found):
            print(f"self-test: rule {rule} missed:\n{text}\n(found: {found})")
            failures += 1
    print(f"self-test: {len(BAD) + 1 - failures} of {len(BAD) + 1} cases behave")
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    if argv[1:] == ["--self-test"]:
        return self_test()
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 64
    with open(argv[1], encoding="utf-8") as f:
        problems = lint(f.read())
    for p in problems:
        print(f"{argv[1]}: {p}")
    if problems:
        return 1
    print(f"{argv[1]}: ok (multi-stage, non-root, healthcheck, pinned-base, copy-from-stage, apt)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
