#!/usr/bin/env python3
"""Compiles the C++ in README.md and docs/*.md, and checks the outputs they show.

  doc_snippets.py extract --root SRC --out DIR FILE.md...   writes the sources and DIR/snippets.cmake
  doc_snippets.py check [--expected FILE [--excerpt]] [--launcher N] -- COMMAND...
      runs COMMAND and compares its stdout with FILE. With GRADCLIP_EMULATOR set (e.g. "qemu-x86_64 -cpu
      Nehalem"), the program runs under that emulator: its words go before COMMAND's word N (0: the
      program; N > 0 when the first N words launch it, as `mpiexec -n 4 --oversubscribe` does).

Conventions in the markdown (docs/development.md, "Code in the docs"):
- A ```cpp block with `int main(` is a program: built on its own with strict warnings and run. If the
  next block (only blank lines between) is a ```text block, or one without an info string, that block
  is what the program must print, exactly.
- Any other ```cpp block is a fragment: its statements become the body of a function, compiled (not
  run) in one translation unit after tests/doc_snippets_prelude.hpp, which declares the names fragments
  use without declaring (`grads`, `optimizer`, ...). `#include` lines move to the top of the unit. An
  HTML comment `<!-- cpp prelude ... -->` right before a block adds declarations that only it sees.
- ```cpp mpi and ```cpp torch blocks are built only where MPI / libtorch is found. ```cpp file=PATH
  says the block is a copy of that file (examples/quickstart.cpp, say): extraction fails if it is not.
- ```text output=TARGET [args=A,B] [ranks=N] [excerpt] is what the example program TARGET prints (run
  under mpiexec on N ranks when given): exactly, or with `excerpt`, its lines in order among the output's.
"""
import argparse
import os
import re
import shlex
import subprocess
import sys

FENCE = re.compile(r"^(\s*)(`{3,})([^`]*)$")  # CommonMark: no backtick in the info string
MAIN = re.compile(r"\bint\s+main\s*\(")
INCLUDE = re.compile(r"^\s*#\s*include\b")
CPP_TAGS = {"mpi", "torch"}


class Block:
    def __init__(self, path, line, info, lines):
        self.path = path  # relative to the source root
        self.line = line  # 1-based line of the first content line
        words = info.split()
        self.language = words[0] if words else ""
        self.tags = words[1:]
        self.lines = lines
        self.prelude = None  # (first line, lines) of a `<!-- cpp prelude -->` comment
        self.output = None  # the output block that follows a program

    def name(self):
        return re.sub(r"[^A-Za-z0-9]+", "_", os.path.splitext(self.path)[0]).strip("_") + "_" + str(self.line)


def fail(path, line, message):
    sys.exit(f"{path}:{line}: {message}")


def parse(root, path):
    """The fenced blocks of one markdown file, each with its hidden prelude, if any."""
    with open(os.path.join(root, path), encoding="utf-8") as f:
        text = f.read().split("\n")
    blocks, prelude, i = [], None, 0
    while i < len(text):
        line = text[i]
        if line.strip().startswith("<!-- cpp prelude"):
            start, body = i + 2, []
            i += 1
            while i < len(text) and text[i].strip() != "-->":
                body.append(text[i])
                i += 1
            if i == len(text):
                fail(path, start - 1, "unterminated <!-- cpp prelude comment (end it with a line '-->')")
            prelude = (start, body)
            i += 1
            continue
        m = FENCE.match(line)
        if not m:
            if line.strip() and prelude is not None:
                fail(path, i + 1, "a <!-- cpp prelude --> comment must be followed by a ```cpp block")
            i += 1
            continue
        indent, ticks, info = len(m.group(1)), len(m.group(2)), m.group(3).strip()
        start, body = i + 2, []
        i += 1
        while i < len(text) and not re.match(r"^\s*`{%d,}\s*$" % ticks, text[i]):
            body.append(text[i][indent:] if text[i][:indent].strip() == "" else text[i])
            i += 1
        if i == len(text):
            fail(path, start - 1, "unterminated code block")
        block = Block(path, start, info, body)
        if prelude is not None:
            if block.language != "cpp":
                fail(path, start - 1, "a <!-- cpp prelude --> comment must be followed by a ```cpp block")
            block.prelude, prelude = prelude, None
        blocks.append((block, i))
        i += 1
    # A program's output: the next block, when only blank lines separate them.
    result = []
    for k, (block, end) in enumerate(blocks):
        result.append(block)
        if block.language != "cpp" or not MAIN.search("\n".join(block.lines)) or k + 1 == len(blocks):
            continue
        following, _ = blocks[k + 1]
        between = text[end + 1 : following.line - 2]
        if all(not s.strip() for s in between) and following.language in ("", "text") and not following.tags:
            block.output = following
    return result


def write_if_changed(path, content):
    """Rewrites a file only when its content changes, so unchanged snippets are not rebuilt."""
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == content:
                return
    except FileNotFoundError:
        pass
    with open(path, "w", encoding="utf-8") as f:
        f.write(content)


def line_directive(block, first):
    return f'#line {first} "{block.path}"'


def fragment_unit(blocks):
    includes, parts = [], []
    for b in blocks:
        body = []
        for s in b.lines:
            if INCLUDE.match(s):
                if s.strip() not in includes:
                    includes.append(s.strip())
                body.append("")  # keeps the #line numbering
            else:
                body.append(s)
        parts.append(f"namespace {b.name()} {{")
        if b.prelude:
            parts += [line_directive(b, b.prelude[0])] + b.prelude[1]
        parts += ["[[maybe_unused]] void snippet() {", line_directive(b, b.line)] + body + ["}", "}"]
    head = ["// Generated by scripts/doc_snippets.py from the markdown: edit the markdown, not this file."]
    head += includes + ['#include "doc_snippets_prelude.hpp"', ""]
    return "\n".join(head + parts) + "\n"


def program_unit(block):
    head = "// Generated by scripts/doc_snippets.py from the markdown: edit the markdown, not this file.\n"
    return head + line_directive(block, block.line) + "\n" + "\n".join(block.lines) + "\n"


def cmake_list(values):
    return '"' + ";".join(v.replace("\\", "/").replace('"', '\\"') for v in values) + '"'


def extract(args):
    os.makedirs(args.out, exist_ok=True)
    fragments = {"": [], "mpi": [], "torch": []}
    programs, outputs = [], []
    for path in args.files:
        for b in parse(args.root, os.path.relpath(os.path.abspath(path), args.root)):
            if b.language == "cpp":
                copies = [t[len("file="):] for t in b.tags if t.startswith("file=")]
                kinds = [t for t in b.tags if not t.startswith("file=")]
                if len(kinds) > 1 or set(kinds) - CPP_TAGS or len(copies) > 1:
                    fail(b.path, b.line - 1, f"a ```cpp block takes at most one of {sorted(CPP_TAGS)} and one file=PATH")
                for copy in copies:
                    with open(os.path.join(args.root, copy), encoding="utf-8") as f:
                        if [s.rstrip() for s in f.read().rstrip("\n").split("\n")] != [s.rstrip() for s in b.lines]:
                            fail(b.path, b.line - 1, f"this block is not a copy of {copy}")
                tag = kinds[0] if kinds else ""
                if MAIN.search("\n".join(b.lines)):
                    if b.prelude:
                        fail(b.path, b.line - 1, "a program (with int main) needs no <!-- cpp prelude -->")
                    programs.append((b, tag))
                else:
                    fragments[tag].append(b)
            elif b.language in ("", "text") and b.tags:
                options = dict(t.split("=", 1) if "=" in t else (t, "") for t in b.tags)
                if "output" not in options or not options["output"] or set(options) - {"output", "args", "ranks", "excerpt"}:
                    fail(b.path, b.line - 1, "an output block's tags are output=TARGET [args=A,B] [ranks=N] [excerpt]")
                outputs.append((b, options))
    lines = ["# Generated by scripts/doc_snippets.py: what the markdown's code blocks are."]
    for tag, blocks in fragments.items():
        source = os.path.join(args.out, f"fragments{'_' + tag if tag else ''}.cpp")
        if blocks:
            write_if_changed(source, fragment_unit(blocks))
        lines.append(f"set(doc_fragments{'_' + tag if tag else ''} {cmake_list([source] if blocks else [])})")
    names = []
    for b, tag in programs:
        name = b.name()
        names.append(name)
        write_if_changed(os.path.join(args.out, name + ".cpp"), program_unit(b))
        expected = ""
        if b.output is not None:
            expected = os.path.join(args.out, name + ".expected")
            write_if_changed(expected, "\n".join(b.output.lines) + "\n")
        lines.append(f"set(doc_program_{name}_tag {cmake_list([tag] if tag else [])})")
        lines.append(f"set(doc_program_{name}_expected {cmake_list([expected] if expected else [])})")
    lines.append(f"set(doc_programs {cmake_list(names)})")
    names = []
    for b, options in outputs:
        name = b.name()
        names.append(name)
        expected = os.path.join(args.out, name + ".expected")
        write_if_changed(expected, "\n".join(b.lines) + "\n")
        lines.append(f"set(doc_output_{name}_target {cmake_list([options['output']])})")
        lines.append(f"set(doc_output_{name}_args {cmake_list(options.get('args', '').split(',') if options.get('args') else [])})")
        lines.append(f"set(doc_output_{name}_ranks {cmake_list([options['ranks']] if options.get('ranks') else [])})")
        lines.append(f"set(doc_output_{name}_excerpt {'ON' if 'excerpt' in options else 'OFF'})")
        lines.append(f"set(doc_output_{name}_expected {cmake_list([expected])})")
    lines.append(f"set(doc_outputs {cmake_list(names)})")
    write_if_changed(os.path.join(args.out, "snippets.cmake"), "\n".join(lines) + "\n")


def check(args):
    command = list(args.command)
    emulator = shlex.split(os.environ.get("GRADCLIP_EMULATOR", ""))
    if not 0 <= args.launcher < len(command):
        sys.exit(f"--launcher {args.launcher}: the command has {len(command)} words")
    command[args.launcher : args.launcher] = emulator
    run = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if run.returncode != 0:
        sys.stderr.write(run.stderr)
        sys.exit(f"{' '.join(command)} exited with {run.returncode}")
    if args.expected is None:
        print(f"{' '.join(command)} ran")
        return
    with open(args.expected, encoding="utf-8") as f:
        expected = f.read().rstrip("\n").split("\n")
    actual = run.stdout.rstrip("\n").split("\n")
    strip = [s.rstrip() for s in actual]
    if args.excerpt:
        k = 0
        for want in expected:
            while k < len(strip) and strip[k] != want.rstrip():
                k += 1
            if k == len(strip):
                sys.exit(f"the documented line\n  {want}\nis not in the program's output (in order):\n" + run.stdout)
            k += 1
    elif strip != [s.rstrip() for s in expected]:
        sys.exit("the documented output:\n" + "\n".join(expected) + "\ndiffers from the program's:\n" + run.stdout)
    print(f"the documented output ({len(expected)} lines) is what {' '.join(command)} prints")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command_name", required=True)
    e = commands.add_parser("extract")
    e.add_argument("--root", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("files", nargs="+")
    c = commands.add_parser("check")
    c.add_argument("--expected")
    c.add_argument("--excerpt", action="store_true")
    c.add_argument("--launcher", type=int, default=0)
    c.add_argument("command", nargs="+")
    args = parser.parse_args()
    extract(args) if args.command_name == "extract" else check(args)


if __name__ == "__main__":
    main()
