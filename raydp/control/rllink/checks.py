"""A run's declaration (its privacy mode and clip decoding) against the policy a server serves (ERRATA E3/E14):
checked by the client before it uploads, by the launcher before a run starts and by a server restoring a saved
policy. Nothing here opens a socket."""

from __future__ import annotations

from raydp.control.modes import DECODINGS, unprotected
from raydp.control.policies import check_policy_decoding
from raydp.control.store import PRIVACY_MODES, check_policy_privacy_mode, policy_action_decoding, policy_privacy_mode
from raydp.errors import ConfigError


def check_served_policy(policy: dict, expect: dict | None, url: str) -> None:
    """ConfigError (one line) unless the server's policy (``env_config["policy"]``) may drive a run with
    ``expect``'s privacy mode and clip decoding (nothing is checked without ``expect``): a paper-mode policy
    saw unprivatized statistics and may not drive a strict run; a paper-mode run would feed unprivatized
    statistics to a strict policy (ERRATA E3/E14); a policy acts in one clip decoding."""
    if not expect:
        return
    served, mode = policy.get("privacy_mode"), expect.get("privacy_mode")
    if served != mode:
        if not unprotected(mode):
            raise ConfigError(f"policy server {url} serves a {served or 'undeclared'}-mode policy; a strict run "
                              "may only use a strict one (ERRATA E3/E14): start the server with a strict config")
        raise ConfigError(f"policy server {url} serves a {served or 'undeclared'}-mode policy; a {mode}-mode run "
                          f"would train it on statistics it may not see (ERRATA E14): use a {mode}-mode server")
    decoding = policy.get("action_decoding")
    if decoding != expect.get("action_decoding"):
        raise ConfigError(f"policy server {url} acts in {decoding!r} clip decoding; this run decodes "
                          f"{expect.get('action_decoding')!r} (set settings.action_decoding: {decoding})")



def run_declaration(expect: dict | None, what: str = "expect") -> dict | None:
    """A run's declaration, ``{"privacy_mode", "action_decoding"}`` (None stays None: a frozen policy's
    client, which uploads nothing); a one-line ConfigError unless both are known values."""
    if expect is None:
        return None
    if (not isinstance(expect, dict) or expect.get("privacy_mode") not in PRIVACY_MODES
            or expect.get("action_decoding") not in DECODINGS):
        shown = {k: expect.get(k) for k in ("privacy_mode", "action_decoding")} if isinstance(expect, dict) else expect
        raise ConfigError(f"{what} must declare the run's privacy_mode (one of {', '.join(PRIVACY_MODES)}) and "
                          f"action_decoding (one of {', '.join(DECODINGS)}); got {str(shown)[:120]}")
    return {"privacy_mode": expect["privacy_mode"], "action_decoding": expect["action_decoding"]}


def check_run_declaration(client, expect: dict) -> None:
    """ConfigError (one line) unless an RLlink client that uploads (``service`` set) declares ``expect``,
    the privacy mode and clip decoding of the run it serves: the server labels and admits the run's
    transitions by that declaration (ERRATA E3/E14). Clients without ``declared`` (the broker's) pass."""
    if getattr(client, "service", None) is None or not hasattr(client, "declared"):
        return
    if client.declared != run_declaration(expect):
        raise ConfigError(f"the RLlink client declares {client.declared} but the run is {run_declaration(expect)}: "
                          "build it with RLlinkPolicyClient(..., expect=<the run's privacy_mode and action_decoding>)")


def served_policy(manifest: dict, expect: dict, name: str) -> dict:
    """What a server restoring the saved policy ``manifest`` serves: its own privacy mode and clip decoding
    (:func:`raydp.control.store.policy_privacy_mode`, :func:`~raydp.control.store.policy_action_decoding`);
    a one-line ConfigError unless they are ``expect``'s (the server's config, whose runs it accepts)."""
    check_policy_privacy_mode(manifest, expect["privacy_mode"], name)  # a paper policy for a strict config
    mode = policy_privacy_mode(manifest)
    if mode != expect["privacy_mode"]:
        raise ConfigError(f"policy {name} is a {mode}-mode policy and this server's config is "
                          f"{expect['privacy_mode']} mode: a server accepts runs of its policy's mode only (ERRATA "
                          f"E3/E14); use a {mode} config")
    check_policy_decoding(manifest, expect["action_decoding"], name)
    return {"privacy_mode": mode, "action_decoding": policy_action_decoding(manifest)}

