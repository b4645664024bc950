"""The launch check: the new launch line through the server's own argument parser (nothing
starts), and who holds the ports the server will bind."""

import os
import subprocess

from .procs import port_holders
from .protocol import LaunchCheck
from .scrub import scrubbed, secret_values

# SGLang's own parser, exactly as prepare_server_args (srt/server_args.py, 0.5.23) builds and
# feeds it, without ServerArgs.__post_init__ (which needs the GPUs): unknown flags, bad values and
# choices exit 2 with argparse's message, as the server would at start.
SGLANG_PARSE_ONLY = "\n".join([
    "import argparse, sys",
    "from sglang.srt.server_args import ServerArgs",
    "argv = sys.argv[1:]",
    "parser = argparse.ArgumentParser(prog='sglang serve')",
    "ServerArgs.add_cli_args(parser)",
    "if '--config' in argv:",
    "    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger",
    "    argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)",
    "parser.parse_args(argv)",
])


def op_launch_check(req: LaunchCheck):
    """Run the new launch line through the server's own argument parser (nothing starts), and
    say who holds the ports it will bind."""
    python, args = req.python, [str(a) for a in req.args]
    if not os.path.isabs(python) or not os.access(python, os.X_OK):
        return {"rc": 127, "stdout": "", "stderr": "%s: not an executable absolute path" % python, "holders": {}}
    if req.sglang:
        argv = [python, "-c", SGLANG_PARSE_ONLY] + args
    else:
        argv = [python, "-m", req.module, "--parse-only"] + args
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=float(req.timeout), cwd="/")
        result = {"rc": r.returncode, "stdout": r.stdout.decode("utf-8", "replace")[-4000:],
                  "stderr": r.stderr.decode("utf-8", "replace")[-4000:]}
    except subprocess.TimeoutExpired:
        result = {"rc": 124, "stdout": "", "stderr": "the parse did not finish in time"}
    secrets = secret_values(req.scrub_files, req.secret_words)
    result = scrubbed(result, secrets)  # SGLang's "unrecognized arguments" error repeats values
    result["holders"] = {str(port): port_holders(int(port)) for port in req.ports}
    return result
