"""Secrets never leave the host: the values of secret-named keys (`api-key: v`, `HF_TOKEN=v`) in
the files the controller names are blanked (***) out of what goes back. SGLang logs its
server_args, API key included, and its parser's errors repeat argument values."""

from .files import text_lines


def secret_values(paths, words):
    """Values of secret-named keys (`api-key: v`, `HF_TOKEN=v`) in the given files, longest first."""
    values = set()
    for path in paths:
        for line in text_lines(path, 1 << 20) or ():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            seps = [i for i in (line.find(":"), line.find("=")) if i > 0]
            if not seps:
                continue
            key, value = line[:min(seps)].strip(), line[min(seps) + 1:].strip()
            if key.startswith("export "):
                key = key[7:].strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            name_words = [w for w in key.upper().replace("-", "_").split("_") if w]
            if len(value) >= 4 and any(w.endswith(s) for w in name_words for s in words):
                values.add(value)
    return sorted(values, key=len, reverse=True)


def scrubbed(result, secrets):
    for value in secrets:
        result["stdout"] = result["stdout"].replace(value, "***")
        result["stderr"] = result["stderr"].replace(value, "***")
    return result
