"""The bundle-signature policy: which signers a bundle is checked against, when a signature is
required, and what is refused. Pure decisions; signing and verifying (ssh-keygen) is bundle.py.

Each host may name `bundle_signers` in the inventory (config.inventory.BundleSigners). For one
command over several hosts:

  source      the hosts' signers              decision
  --bundle    none                            opened without reading any signature
  --bundle    some, none required             a signature present is verified against each;
                                              an unsigned bundle goes on
  --bundle    some required                   the signature must be there and good for each
  --bundle    + --allow-unsigned              refused: a bundle is always checked
  --patchset  some required, command deploys  refused, unless --allow-unsigned (then a warning)
  --patchset  otherwise                       goes on (plan and render change nothing)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol

from ..errors import InputError

SHOWN_HOSTS = 5  # hosts named in a refusal; more are "…"


class SignerPolicy(Protocol):
    """Who may sign bundles (the inventory's `bundle_signers`, config.inventory.BundleSigners)."""

    allowed_signers: str
    identity: str
    required: bool


class Source(enum.Enum):
    BUNDLE = "bundle"  # a built, possibly signed, bundle file
    PATCHSET = "patchset"  # a patch set from a working tree: never signed


class SignatureCheck(enum.Enum):
    """What opening one bundle does about its signature."""

    SKIP = "skip"  # no signers: the signature, if any, is not read
    VERIFY = "verify"  # verified against every signer policy; a bad one is refused
    MISSING = "missing"  # a policy requires a signature and there is none: refused


@dataclass(frozen=True)
class SignatureDecision:
    """What a command does about signatures: the policies a bundle is checked against and a
    warning to say before going on (an unsigned patch set deployed with --allow-unsigned)."""

    signers: tuple[SignerPolicy, ...]
    warning: str | None = None

    def note(self, signed_by: Iterable[str]) -> str:
        """What the "bundle ... verified" line says about the signature: who signed it,
        "not signed" where the inventory has signers, nothing where it has none."""
        who = "; ".join(signed_by)
        if who:
            return f", {who}"
        return ", not signed" if self.signers else ""


def unique_signers(signers_by_host: Mapping[str, SignerPolicy | None]) -> tuple[SignerPolicy, ...]:
    """Every distinct policy of the hosts, in host order (hosts sharing one are checked once)."""
    return tuple(dict.fromkeys(s for s in signers_by_host.values() if s is not None))


def decide(signers_by_host: Mapping[str, SignerPolicy | None], source: Source, *, patchset: str,
           unsigned_patchset_ok: bool, allow_unsigned: bool = False) -> SignatureDecision:
    """The decision for a command over the hosts of `signers_by_host` (host name → its
    `bundle_signers`, None: none). `unsigned_patchset_ok`: the command changes nothing (plan,
    render), so a working tree may be used whatever the inventory requires. `patchset` names the
    patch set in messages. InputError (exit 2) for what is refused."""
    signers = unique_signers(signers_by_host)
    required = sorted(h for h, s in signers_by_host.items() if s is not None and s.required)
    if source is Source.BUNDLE:
        if allow_unsigned:
            raise InputError("--allow-unsigned is for --patchset only: a bundle is always checked against the "
                             "inventory's bundle_signers")
        return SignatureDecision(signers)
    if not required:
        return SignatureDecision(signers)
    if allow_unsigned:
        return SignatureDecision(signers, f"--allow-unsigned: deploying the unsigned patch set {patchset} "
                                          f"although the inventory requires signed bundles")
    if unsigned_patchset_ok:
        return SignatureDecision(signers)
    more = " …" if len(required) > SHOWN_HOSTS else ""
    raise InputError(f"{', '.join(required[:SHOWN_HOSTS])}{more}: the inventory requires signed bundles "
                     f"(bundle_signers.required): deploy a signed --bundle, or pass --allow-unsigned to "
                     f"deploy the unsigned patch set {patchset}")


def bundle_check(signers: Iterable[SignerPolicy], signature_present: bool) -> SignatureCheck:
    """What opening a bundle does about its signature, given the command's signers."""
    policies = tuple(signers)
    if signature_present and policies:
        return SignatureCheck.VERIFY
    if any(p.required for p in policies):
        return SignatureCheck.MISSING
    return SignatureCheck.SKIP
