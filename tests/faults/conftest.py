import pytest


def pytest_collection_modifyitems(items):
    """Every test under tests/faults is a fault-injection test (`-m faults` selects them)."""
    for item in items:
        if "tests/faults/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.faults)
