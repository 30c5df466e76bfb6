# What the GPU tables' drivers (torch_door/driver.py, fragmentation/driver.py) share: how a
# failed run's log is summed up in one table cell.


def last_error_line(path):
    """The last line of the log at `path` that names an error, else its last line."""
    try:
        lines = [l.strip() for l in open(path, errors="replace") if l.strip() and not l.startswith("[driver]")]
    except OSError:
        return "no log"
    for l in reversed(lines):
        if "Error" in l or "error" in l or "Exception" in l:
            return l
    return lines[-1] if lines else "empty log"
