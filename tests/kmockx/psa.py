"""Pod Security admission for kmockx: namespaces labelled ``pod-security.kubernetes.io/enforce=baseline|restricted``
refuse pods that violate that level (the Pod Security Standards, "latest" version), with the API server's message:
``pods "x" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false (...)``.

One table, ``CHECKS``: (level, check). Each check takes the pod and returns None or (title, detail), worded
as pod-security-admission words them. ``restricted`` runs the baseline checks too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ENFORCE = "pod-security.kubernetes.io/enforce"
LEVELS = ("privileged", "baseline", "restricted")

BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod.get("spec") or {}
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or []),
            *(spec.get("ephemeralContainers") or [])]


def _sc(c: dict[str, Any]) -> dict[str, Any]:
    return c.get("securityContext") or {}


def _psc(pod: dict[str, Any]) -> dict[str, Any]:
    return (pod.get("spec") or {}).get("securityContext") or {}


def _names(cs: list[dict[str, Any]]) -> str:
    word = "container" if len(cs) == 1 else "containers"
    return f'{word} {", ".join(repr(c["name"]).replace(chr(39), chr(34)) for c in cs)}'


def _quoted(items: Any) -> str:
    return ", ".join(f'"{i}"' for i in items)


def host_namespaces(pod: dict[str, Any]) -> tuple[str, str] | None:
    spec = pod.get("spec") or {}
    bad = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    return ("host namespaces", ", ".join(bad)) if bad else None


def privileged(pod: dict[str, Any]) -> tuple[str, str] | None:
    cs = [c for c in _containers(pod) if _sc(c).get("privileged")]
    return ("privileged", f"{_names(cs)} must not set securityContext.privileged=true") if cs else None


def baseline_capabilities(pod: dict[str, Any]) -> tuple[str, str] | None:
    added = {c["name"]: [a for a in (_sc(c).get("capabilities") or {}).get("add") or [] if a not in BASELINE_CAPS]
             for c in _containers(pod)}
    cs = [c for c in _containers(pod) if added[c["name"]]]
    caps = sorted({a for v in added.values() for a in v})
    return ("non-default capabilities", f"{_names(cs)} must not include {_quoted(caps)} in "
            "securityContext.capabilities.add") if cs else None


def host_path_volumes(pod: dict[str, Any]) -> tuple[str, str] | None:
    vols = [v["name"] for v in (pod.get("spec") or {}).get("volumes") or [] if "hostPath" in v]
    return ("hostPath volumes", f"volume{'s' if len(vols) > 1 else ''} {_quoted(vols)}") if vols else None


def host_ports(pod: dict[str, Any]) -> tuple[str, str] | None:
    cs = [c for c in _containers(pod) if any(p.get("hostPort") for p in c.get("ports") or [])]
    ports = sorted({str(p["hostPort"]) for c in cs for p in c.get("ports") or [] if p.get("hostPort")})
    return ("hostPort", f"{_names(cs)} use{'s' if len(cs) == 1 else ''} {', '.join(ports)}") if cs else None


def seccomp_baseline(pod: dict[str, Any]) -> tuple[str, str] | None:
    bad = (_psc(pod).get("seccompProfile") or {}).get("type") == "Unconfined" or any(
        (_sc(c).get("seccompProfile") or {}).get("type") == "Unconfined" for c in _containers(pod))
    return ("seccompProfile", 'pod or containers must not set securityContext.seccompProfile.type to '
            '"Unconfined"') if bad else None


def sysctls(pod: dict[str, Any]) -> tuple[str, str] | None:
    bad = [s["name"] for s in _psc(pod).get("sysctls") or [] if s["name"] not in SAFE_SYSCTLS]
    return ("forbidden sysctls", ", ".join(bad)) if bad else None


def proc_mount(pod: dict[str, Any]) -> tuple[str, str] | None:
    cs = [c for c in _containers(pod) if _sc(c).get("procMount") not in (None, "Default")]
    return ("procMount", f'{_names(cs)} must not set securityContext.procMount to "Unmasked"') if cs else None


def restricted_volumes(pod: dict[str, Any]) -> tuple[str, str] | None:
    bad = [v["name"] for v in (pod.get("spec") or {}).get("volumes") or []
           if not (set(v) - {"name"}) <= RESTRICTED_VOLUMES]
    types = sorted({k for v in (pod.get("spec") or {}).get("volumes") or [] if v["name"] in bad for k in v
                    if k != "name"})
    return ("restricted volume types", f"volume{'s' if len(bad) > 1 else ''} {_quoted(bad)} use"
            f"{'s' if len(bad) == 1 else ''} restricted volume type{'s' if len(types) > 1 else ''} "
            f"{_quoted(types)}") if bad else None


def privilege_escalation(pod: dict[str, Any]) -> tuple[str, str] | None:
    cs = [c for c in _containers(pod) if _sc(c).get("allowPrivilegeEscalation") is not False]
    return ("allowPrivilegeEscalation != false",
            f"{_names(cs)} must set securityContext.allowPrivilegeEscalation=false") if cs else None


def restricted_capabilities(pod: dict[str, Any]) -> tuple[str, str] | None:
    no_drop = [c for c in _containers(pod) if "ALL" not in ((_sc(c).get("capabilities") or {}).get("drop") or [])]
    adds = [c for c in _containers(pod) if set((_sc(c).get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}]
    parts = []
    if no_drop:
        parts.append(f'{_names(no_drop)} must set securityContext.capabilities.drop=["ALL"]')
    if adds:
        parts.append(f'{_names(adds)} must not include {_quoted(sorted({a for c in adds for a in _sc(c)["capabilities"]["add"] if a != "NET_BIND_SERVICE"}))} in securityContext.capabilities.add')
    return ("unrestricted capabilities", "; ".join(parts)) if parts else None


def run_as_non_root(pod: dict[str, Any]) -> tuple[str, str] | None:
    pod_level = _psc(pod).get("runAsNonRoot") is True
    cs = [c for c in _containers(pod) if _sc(c).get("runAsNonRoot") is False
          or not pod_level and _sc(c).get("runAsNonRoot") is not True]
    return ("runAsNonRoot != true", f"pod or {_names(cs)} must set securityContext.runAsNonRoot=true") if cs else None


def run_as_user(pod: dict[str, Any]) -> tuple[str, str] | None:
    root = _psc(pod).get("runAsUser") == 0
    cs = [c for c in _containers(pod) if _sc(c).get("runAsUser") == 0]
    if not root and not cs:
        return None
    return ("runAsUser=0", "pod must not set runAsUser=0" if root else f"{_names(cs)} must not set runAsUser=0")


def seccomp_restricted(pod: dict[str, Any]) -> tuple[str, str] | None:
    ok = ("RuntimeDefault", "Localhost")
    pod_ok = (_psc(pod).get("seccompProfile") or {}).get("type") in ok
    cs = [c for c in _containers(pod) if (_sc(c).get("seccompProfile") or {}).get("type") not in ok
          and not (pod_ok and not _sc(c).get("seccompProfile"))]
    return ("seccompProfile", f'pod or {_names(cs)} must set securityContext.seccompProfile.type to '
            '"RuntimeDefault" or "Localhost"') if cs else None


Check = Callable[[dict[str, Any]], "tuple[str, str] | None"]
CHECKS: list[tuple[str, Check]] = [
    ("baseline", host_namespaces),
    ("baseline", privileged),
    ("baseline", baseline_capabilities),
    ("baseline", host_path_volumes),
    ("baseline", host_ports),
    ("baseline", seccomp_baseline),
    ("baseline", sysctls),
    ("baseline", proc_mount),
    ("restricted", restricted_volumes),
    ("restricted", privilege_escalation),
    ("restricted", restricted_capabilities),
    ("restricted", run_as_non_root),
    ("restricted", run_as_user),
    ("restricted", seccomp_restricted),
]


def violations(pod: dict[str, Any], level: str) -> list[str]:
    """``title (detail)`` for every check of ``level`` (and below) the pod fails, in the table's order."""
    wanted = LEVELS.index(level)
    out = []
    for lvl, check in CHECKS:
        if LEVELS.index(lvl) <= wanted and (v := check(pod)) is not None:
            out.append(f"{v[0]} ({v[1]})")
    return out


def admit(emulator: Any, pod: dict[str, Any]) -> str | None:
    """The denial (after ``pods "x" is forbidden: ``) for a pod created in an enforcing namespace, else None."""
    ns = emulator.get("v1/namespaces", None, (pod.get("metadata") or {}).get("namespace"))
    level = ((ns or {}).get("metadata", {}).get("labels") or {}).get(ENFORCE)
    if level not in ("baseline", "restricted"):
        return None
    found = violations(pod, level)
    return f'violates PodSecurity "{level}:latest": {", ".join(found)}' if found else None
