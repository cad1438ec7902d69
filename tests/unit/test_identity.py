"""Whether a recorded process identity can name a process here (ringd.core.identity):
the boot and the pid namespace, as each side of a container sees them."""
from ringd.core.identity import recorded_here

NS, OTHER_NS = 4026532178, 4026531836
KERNEL = {"boot_id": "k-1", "boot_view": "kernel", "pid_ns": NS}       # a unit's private procfs (ProtectProc=)
SHELL = {"boot_id": "c-1", "boot_view": "mounted", "pid_ns": NS}       # a root shell in the same container


def test_a_unit_and_a_shell_of_one_container_see_one_another_though_their_boot_ids_differ():
    assert recorded_here(KERNEL, SHELL) and recorded_here(SHELL, KERNEL)


def test_the_same_view_compares_boot_ids_a_reboot_names_nobody():
    assert recorded_here(KERNEL, KERNEL) and recorded_here(SHELL, SHELL)
    assert not recorded_here(dict(KERNEL, boot_id="k-0"), KERNEL)      # an earlier boot
    assert not recorded_here(dict(SHELL, boot_id="c-0"), SHELL)        # an earlier boot of the container


def test_another_pid_namespace_names_another_process_whatever_the_boot():
    for rec in (dict(KERNEL, pid_ns=OTHER_NS), dict(SHELL, pid_ns=OTHER_NS)):
        assert not recorded_here(rec, KERNEL) and not recorded_here(rec, SHELL)
    assert not recorded_here({"pid_ns": OTHER_NS}, KERNEL)


def test_different_views_without_a_shared_namespace_fall_back_on_the_boot_id():
    assert not recorded_here(dict(KERNEL, pid_ns=None), SHELL)
    assert not recorded_here(KERNEL, dict(SHELL, pid_ns=None))


def test_what_a_record_lacks_is_not_compared_and_a_malformed_one_never_matches():
    assert recorded_here({}, KERNEL)                                        # a file from before ring recorded any
    assert recorded_here({"boot_id": "k-1"}, KERNEL)                        # from before views and namespaces
    assert not recorded_here({"boot_id": "k-0"}, KERNEL)
    assert recorded_here(KERNEL, {"boot_id": None, "boot_view": None, "pid_ns": None})   # no /proc to compare
    for bad in ({"boot_id": 7}, {"boot_id": ""}, {"pid_ns": "x"}, dict(SHELL, boot_view="weird", pid_ns=NS)):
        assert not recorded_here(bad, KERNEL), bad
