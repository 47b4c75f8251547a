"""Where the native CPU library is loaded from (``kernels/native.py``): never from a folder another
user could have written. Without a writable home the cache is ``<tmp>/orbitkv-native-<uid>/<key>/``,
a predictable path: a library planted there (in a folder that is world-writable, another user's, or
a link) must not be loaded; the real one is built in a private folder instead."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from orbitkv.kernels import native

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C++ compiler on PATH")

PLANTED_VERSION = 666


@pytest.fixture
def no_home(tmp_path, monkeypatch):
    """A home whose cache cannot be made (its parent is a file, which stops root too) and a temp
    dir of the test's own; returns ``(the shared temp-dir cache folder, the build key)``."""
    (tmp_path / "home").write_text("a file, not a folder")
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path / "home" / ".cache" / "native")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    # Unoptimized: what is tested is where the library comes from, and -O3 takes seconds a build.
    monkeypatch.setattr(native, "FLAGS", ("-O0", *native.FLAGS[1:]))
    return tmp / f"orbitkv-native-{os.getuid()}", native._build_key(native._compiler())


def _plant(folder: Path, tmp_path: Path) -> Path:
    """A real shared library at the cache path, with a version the real one never reports."""
    src = tmp_path / "planted.cpp"
    src.write_text(f'extern "C" int orbitkv_native_version() {{ return {PLANTED_VERSION}; }}\n')
    folder.mkdir(parents=True, exist_ok=True)
    lib = folder / native.LIB_NAME
    subprocess.run([native._compiler(), "-shared", "-fPIC", str(src), "-o", str(lib)], check=True,
                   capture_output=True, timeout=120)
    return lib


def _version(path: Path) -> int:
    lib = ctypes.CDLL(str(path))
    lib.orbitkv_native_version.restype = ctypes.c_int
    return lib.orbitkv_native_version()


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_temp_dir_cache_is_private_and_reused(no_home):
    shared, key = no_home
    path = native.build()
    assert path == shared / key / native.LIB_NAME and _version(path) == native.VERSION
    assert _mode(shared) == _mode(shared / key) == 0o700
    assert not _mode(path) & (stat.S_IWGRP | stat.S_IWOTH)
    built_ns = os.stat(path).st_mtime_ns
    assert native.build() == path and os.stat(path).st_mtime_ns == built_ns  # not rebuilt


@pytest.mark.parametrize("attack", ["world_writable_folder", "world_writable_root",
                                    "other_users_folder", "linked_root"])
def test_a_library_planted_at_the_predictable_path_is_not_loaded(no_home, tmp_path, attack, caplog):
    shared, key = no_home
    if attack == "linked_root":  # the uid's folder is a link to one the attacker owns
        elsewhere = tmp_path / "attacker"
        planted = _plant(elsewhere / key, tmp_path)
        os.chmod(elsewhere, 0o700)
        os.chmod(elsewhere / key, 0o700)
        shared.symlink_to(elsewhere, target_is_directory=True)
    else:
        planted = _plant(shared / key, tmp_path)
        os.chmod(shared, 0o777 if attack == "world_writable_root" else 0o700)
        os.chmod(shared / key, 0o777 if attack == "world_writable_folder" else 0o700)
        if attack == "other_users_folder":
            if os.getuid() != 0:
                pytest.skip("making a folder another user's needs root")
            for p in (shared, shared / key, planted):
                os.chown(p, 65534, 65534)
    path = native.build()
    assert _version(path) == native.VERSION, "the planted library was loaded"
    assert path.resolve() != planted.resolve()
    assert not path.resolve().is_relative_to(shared.resolve())
    assert _mode(path.parent) == 0o700 and os.lstat(path.parent).st_uid == os.getuid()
    assert "not loading a cached library" in caplog.text
    assert _version(planted) == PLANTED_VERSION  # the plant itself was a loadable library
    shutil.rmtree(path.parent)


def test_a_library_writable_by_others_in_our_folder_is_rebuilt(no_home, tmp_path):
    """Ours, in our private folder, but group/world-writable (built under a loose umask): replaced."""
    shared, key = no_home
    planted = _plant(shared / key, tmp_path)
    os.chmod(shared, 0o700)
    os.chmod(shared / key, 0o700)
    os.chmod(planted, 0o777)
    path = native.build()
    assert path == planted and _version(path) == native.VERSION
    assert not _mode(path) & (stat.S_IWGRP | stat.S_IWOTH)
