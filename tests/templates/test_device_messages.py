"""Device-side assertion messages fit CUDA's limit.

``torch._assert_async(cond, msg)`` on a CUDA tensor refuses a message of 255 characters or more
("RuntimeError: Message length must be smaller than 255"), before the condition is even looked at; on the CPU
any length passes. On the first GPU run (an H200, 2026-12-04) every store raised that, because the block-table
overflow message was about 300 characters. No CPU run of a kernel can see it, so this reads every call in the
package's source and evaluates its message in its module.
"""
import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# source folder -> the package it installs as (pyproject.toml's package-dir)
PACKAGES = {"kvcompile": "kvcompile", "passes": "kvcompile.passes", "templates": "kvcompile.templates"}
CUDA_LIMIT = 255  # c10's check: the message length must be smaller than this


def device_assert_messages():
    """(where, module name, message expression or None) for every ``*._assert_async(...)`` call in the package."""
    found = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            module = package if path.stem == "__init__" else f"{package}.{path.stem}"
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr == "_assert_async":
                    msg = node.args[1] if len(node.args) > 1 else next(
                        (k.value for k in node.keywords if k.arg == "assert_msg"), None)
                    found.append((f"{path.relative_to(ROOT)}:{node.lineno}", module, msg))
    return found


def test_every_device_assert_message_fits_cuda():
    calls = device_assert_messages()
    assert calls, "no torch._assert_async call found: the scan is looking in the wrong place"
    for where, module, expr in calls:
        if expr is None:
            continue
        try:  # the message as the module defines it (a constant, or a module-level name)
            msg = eval(compile(ast.Expression(expr), where, "eval"), vars(importlib.import_module(module)))
        except NameError as e:
            pytest.fail(f"{where}: the device-assert message {ast.unparse(expr)} is not a module-level constant "
                        f"({e}); make it one, so its length can be checked here")
        assert isinstance(msg, str), (where, msg)
        assert len(msg) < CUDA_LIMIT, (f"{where}: device-assert message of {len(msg)} characters; CUDA refuses "
                                       f"{CUDA_LIMIT} or more: {msg!r}")


def test_the_scan_sees_the_store_launchers_assert():
    """The block-table overflow check of ``templates.launch.store`` is among the calls found, with its real
    (short) message, and the long one it replaced would fail the limit."""
    from kvcompile.templates import launch

    calls = {(module, ast.unparse(expr)) for _, module, expr in device_assert_messages() if expr is not None}
    assert ("kvcompile.templates.launch", "UNRESERVED_DEVICE") in calls
    assert len(launch.UNRESERVED_DEVICE) < CUDA_LIMIT <= len(launch.UNRESERVED)
