"""Exported function names of an ELF shared library, read from its dynamic symbol table; the libraries it
names as needed, read from its dynamic section.

Used to probe only the llama.cpp functions a given libllama.so really exports (bpftrace refuses the
whole program when one uprobe target is missing, and older builds lack `llama_process`), and whether a
ggml CPU library links OpenMP itself (`ggml.lib`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

_SHT_DYNSYM = 11
_SHT_DYNAMIC = 6
_DT_NULL, _DT_NEEDED = 0, 1
_STB_GLOBAL, _STB_WEAK = 1, 2
_STT_FUNC, _STT_GNU_IFUNC = 2, 10
_STV_HIDDEN, _STV_INTERNAL = 2, 1


class ElfError(ValueError):
    """The file is not an ELF object this reader understands."""


def _layout(ident: bytes) -> tuple[str, bool]:
    if ident[:4] != b"\x7fELF":
        raise ElfError("not an ELF file")
    if ident[4] not in (1, 2) or ident[5] not in (1, 2):
        raise ElfError("unknown ELF class or byte order")
    return ("<" if ident[5] == 1 else ">"), ident[4] == 2


def _sections(fh, order: str, is64: bool) -> list[tuple[int, int, int, int, int]]:
    """(type, offset, size, link, entsize) of every section."""
    fh.seek(0)
    header = fh.read(64)
    if is64:
        (shoff,) = struct.unpack_from(order + "Q", header, 0x28)
        shentsize, shnum = struct.unpack_from(order + "HH", header, 0x3A)
        fmt = order + "IIQQQQIIQQ"
    else:
        (shoff,) = struct.unpack_from(order + "I", header, 0x20)
        shentsize, shnum = struct.unpack_from(order + "HH", header, 0x2E)
        fmt = order + "IIIIIIIIII"
    if shnum == 0 or shnum > 65535 or shentsize < struct.calcsize(fmt):
        raise ElfError("no section headers")
    fh.seek(shoff)
    table = fh.read(shentsize * shnum)
    out = []
    for i in range(shnum):
        f = struct.unpack_from(fmt, table, i * shentsize)
        out.append((f[1], f[4], f[5], f[6], f[9]))
    return out


def _read(fh, offset: int, size: int) -> bytes:
    fh.seek(offset)
    data = fh.read(size)
    if len(data) != size:
        raise ElfError("section runs past the end of the file")
    return data


def _tables(
    fh, sections: list[tuple[int, int, int, int, int]], kind: int
) -> Iterator[tuple[bytes, bytes, int]]:
    """Each section of `kind` with its linked string table: (the string table, the section's bytes, its
    entry size or 0)."""
    for section_kind, offset, size, link, entsize in sections:
        if section_kind != kind or link >= len(sections):
            continue
        yield _read(fh, sections[link][1], sections[link][2]), _read(fh, offset, size), entsize


def _string(strtab: bytes, offset: int) -> str:
    """The NUL-terminated name at `offset` of a string table."""
    end = strtab.find(b"\0", offset)
    return strtab[offset : end if end >= 0 else None].decode("utf-8", "replace")


def exported_functions(path: str | Path) -> set[str]:
    """Names of the functions `path` defines and exports (global or weak, default visibility).

    Raises:
        ElfError: not a readable ELF object. OSError: the file cannot be opened.
    """
    with open(path, "rb") as fh:
        order, is64 = _layout(fh.read(16))
        sections = _sections(fh, order, is64)
        names: set[str] = set()
        sym_fmt = order + ("IBBHQQ" if is64 else "IIIBBH")
        for strtab, symtab, entsize in _tables(fh, sections, _SHT_DYNSYM):
            step = entsize or struct.calcsize(sym_fmt)
            for pos in range(step, len(symtab) - step + 1, step):  # entry 0 is the null symbol
                fields = struct.unpack_from(sym_fmt, symtab, pos)
                name_off, info, other, shndx = (
                    (fields[0], fields[1], fields[2], fields[3])
                    if is64
                    else (fields[0], fields[3], fields[4], fields[5])
                )
                bind, typ = info >> 4, info & 0xF
                if shndx == 0 or bind not in (_STB_GLOBAL, _STB_WEAK):
                    continue
                if typ not in (_STT_FUNC, _STT_GNU_IFUNC) or other & 3 in (_STV_HIDDEN, _STV_INTERNAL):
                    continue
                names.add(_string(strtab, name_off))
        return names


def needed_libraries(path: str | Path) -> list[str]:
    """The libraries `path` names as DT_NEEDED, in order ([] where it has no dynamic section).

    Raises:
        ElfError: not a readable ELF object. OSError: the file cannot be opened.
    """
    with open(path, "rb") as fh:
        order, is64 = _layout(fh.read(16))
        sections = _sections(fh, order, is64)
        names: list[str] = []
        entry = order + ("qQ" if is64 else "iI")
        for strtab, dynamic, entsize in _tables(fh, sections, _SHT_DYNAMIC):
            step = entsize or struct.calcsize(entry)
            for pos in range(0, len(dynamic) - step + 1, step):
                tag, value = struct.unpack_from(entry, dynamic, pos)
                if tag == _DT_NULL:
                    break
                if tag == _DT_NEEDED:
                    names.append(_string(strtab, value))
        return names
