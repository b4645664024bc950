"""The bundle-signature policy (artifacts/signature_policy.py) from data: the decision a command
takes for its hosts' signers, what opening a bundle does about its signature, and real bundles
signed or not, checked against no, optional or required signers, as built or tampered with."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ddtree_ops.artifacts.bundle import build_bundle, open_bundle, sign_bundle, signature_path
from ddtree_ops.artifacts.signature_policy import (
    SignatureCheck,
    SignatureDecision,
    Source,
    bundle_check,
    decide,
    unique_signers,
)
from ddtree_ops.config.inventory import BundleSigners
from ddtree_ops.errors import BundleError, InputError
from fast_kit import PROBE_REL, write_patchset

SSH_KEYGEN = shutil.which("ssh-keygen")
needs_ssh_keygen = pytest.mark.skipif(SSH_KEYGEN is None, reason="needs OpenSSH's ssh-keygen")

REQUIRED = BundleSigners("/etc/ddtree/allowed_signers", "rel@example.org", required=True)
OPTIONAL = BundleSigners("/etc/ddtree/allowed_signers", "rel@example.org", required=False)
SIGNERS = {"none": None, "optional": OPTIONAL, "required": REQUIRED}


# --------------------------------------------------------------------------- decide: a table

REFUSED_UNSIGNED = "a: the inventory requires signed bundles (bundle_signers.required)"
REFUSED_FLAG = "--allow-unsigned is for --patchset only"
WARNED = "--allow-unsigned: deploying the unsigned patch set ps although the inventory requires signed bundles"


@pytest.mark.parametrize("source, signers, unsigned_ok, allow_unsigned, refused, warning", [
    # a bundle: checked against every signer the hosts name; --allow-unsigned never applies
    (Source.BUNDLE, "none", False, False, None, None),
    (Source.BUNDLE, "optional", False, False, None, None),
    (Source.BUNDLE, "required", False, False, None, None),
    (Source.BUNDLE, "none", False, True, REFUSED_FLAG, None),
    (Source.BUNDLE, "required", True, True, REFUSED_FLAG, None),
    # a patch set from a working tree: refused only where a signature is required and the command
    # deploys, unless --allow-unsigned (said as a warning)
    (Source.PATCHSET, "none", False, False, None, None),
    (Source.PATCHSET, "optional", False, False, None, None),
    (Source.PATCHSET, "required", False, False, REFUSED_UNSIGNED, None),
    (Source.PATCHSET, "required", True, False, None, None),
    (Source.PATCHSET, "required", False, True, None, WARNED),
    (Source.PATCHSET, "optional", False, True, None, None),
    (Source.PATCHSET, "none", False, True, None, None),
])
def test_the_decision_for_each_source_signer_policy_and_flag(source, signers, unsigned_ok, allow_unsigned,
                                                             refused, warning):
    hosts = {"a": SIGNERS[signers], "b": None}
    if refused:
        with pytest.raises(InputError) as e:
            decide(hosts, source, patchset="ps", unsigned_patchset_ok=unsigned_ok, allow_unsigned=allow_unsigned)
        assert str(e.value).startswith(refused), str(e.value)
        return
    d = decide(hosts, source, patchset="ps", unsigned_patchset_ok=unsigned_ok, allow_unsigned=allow_unsigned)
    assert d.warning == warning
    assert d.signers == (() if signers == "none" else (SIGNERS[signers],))


def test_a_refusal_names_the_hosts_that_require_signatures_sorted_and_at_most_five():
    hosts = {f"h{i}": REQUIRED for i in (7, 1, 3, 2, 6, 5, 4)} | {"free": None, "opt": OPTIONAL}
    with pytest.raises(InputError) as e:
        decide(hosts, Source.PATCHSET, patchset="ddtree-temp", unsigned_patchset_ok=False)
    msg = str(e.value)
    assert msg.startswith("h1, h2, h3, h4, h5 …: the inventory requires signed bundles")
    assert "h6" not in msg and "free" not in msg and "opt" not in msg
    assert msg.endswith("--allow-unsigned to deploy the unsigned patch set ddtree-temp")


def test_hosts_sharing_a_policy_check_it_once_in_host_order():
    other = BundleSigners("/etc/other", "ops@example.org", required=False)
    assert unique_signers({"a": REQUIRED, "b": other, "c": REQUIRED, "d": None}) == (REQUIRED, other)
    assert unique_signers({"a": None}) == ()


@pytest.mark.parametrize("signers, present, check", [
    ((), False, SignatureCheck.SKIP),
    ((), True, SignatureCheck.SKIP),  # nobody to check it against: not read
    ((OPTIONAL,), False, SignatureCheck.SKIP),
    ((OPTIONAL,), True, SignatureCheck.VERIFY),
    ((REQUIRED,), False, SignatureCheck.MISSING),
    ((REQUIRED,), True, SignatureCheck.VERIFY),
    ((OPTIONAL, REQUIRED), False, SignatureCheck.MISSING),  # one policy requiring it is enough
])
def test_what_opening_a_bundle_does_about_its_signature(signers, present, check):
    assert bundle_check(signers, present) is check


@pytest.mark.parametrize("signers, signed_by, note", [
    ((), (), ""),
    ((OPTIONAL,), (), ", not signed"),
    ((REQUIRED,), ("Good signature for rel@example.org",), ", Good signature for rel@example.org"),
    ((REQUIRED, OPTIONAL), ("one", "two"), ", one; two"),
])
def test_the_verified_line_says_who_signed_or_that_nobody_did(signers, signed_by, note):
    assert SignatureDecision(signers).note(signed_by) == note


# --------------------------------------------------------------------------- real bundles

def _keygen(tmp_path: Path, name: str) -> Path:
    key = tmp_path / "keys" / name
    key.parent.mkdir(exist_ok=True)
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)], check=True)
    return key


def _policies(tmp_path: Path, key: Path) -> dict[str, BundleSigners | None]:
    pub = key.with_suffix(".pub").read_text().split()
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f"rel@example.org {pub[0]} {pub[1]}\n")
    return {"none": None,
            "optional": BundleSigners(str(allowed), "rel@example.org", required=False),
            "required": BundleSigners(str(allowed), "rel@example.org", required=True)}


def _bundle(tmp_path: Path, content: bytes, out: str) -> Path:
    ps = write_patchset(tmp_path / out, {PROBE_REL: content}, name="policy")
    return build_bundle(str(ps), tmp_path / out / "dist").path


OPENS, NOT_SIGNED = "opens signed", "opens unsigned"
NO_SIGNATURE = "has no signature"
BAD_SIGNATURE = "is not a good signature by 'rel@example.org'"


@needs_ssh_keygen
@pytest.mark.parametrize("signed, signers, tampered, outcome", [
    (False, "none", False, NOT_SIGNED),
    (False, "optional", False, NOT_SIGNED),
    (False, "required", False, NO_SIGNATURE),
    (True, "none", False, NOT_SIGNED),  # no signers: the signature is not read
    (True, "optional", False, OPENS),
    (True, "required", False, OPENS),
    # tampered: the file replaced by another well-formed bundle, its old signature kept
    (True, "none", True, NOT_SIGNED),  # the control: without signers nothing can tell
    (True, "optional", True, BAD_SIGNATURE),
    (True, "required", True, BAD_SIGNATURE),
    (False, "required", True, NO_SIGNATURE),
])
def test_signed_or_unsigned_bundles_against_each_signer_policy(tmp_path, signed, signers, tampered, outcome):
    key = _keygen(tmp_path, "release")
    policy = _policies(tmp_path, key)[signers]
    path = tmp_path / "release.tar.gz"  # a name that is no id: the content alone says which bundle it is
    shutil.copyfile(_bundle(tmp_path, b"P = 1\n", "a"), path)
    if signed:
        sign_bundle(path, key)
    if tampered:
        shutil.copyfile(_bundle(tmp_path, b"P = 2  # not what was signed\n", "b"), path)
    decision = decide({"h": policy}, Source.BUNDLE, patchset="-", unsigned_patchset_ok=False)
    if outcome in (OPENS, NOT_SIGNED):
        with open_bundle(path, signers=decision.signers) as b:
            assert (b.patchset.files[0].source.read_bytes() == b"P = 2  # not what was signed\n") is tampered
            assert bool(b.signed_by) is (outcome == OPENS)
            if outcome == OPENS:
                assert "rel@example.org" in b.signed_by[0]
        return
    with pytest.raises(BundleError) as e:
        open_bundle(path, signers=decision.signers)
    assert outcome in str(e.value) and str(path) in str(e.value)
    assert signature_path(path).exists() is signed
