"""Hosts made of network namespaces, shared by the multi-host tests.

BridgedHosts builds n namespaces ("hosts"), each with one interface of the
same name and its own address, joined through a Linux bridge in another
namespace (the switch). Names carry a tag (with the test's pid) so that
concurrent tests do not collide; teardown removes the namespaces, and with
them every veth and the bridge, on every path."""
import os
import shutil
import subprocess


def sh(*args, check=True):
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


def usable(tag, tools=("ip",)):
    """None when this process can build namespaces, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in tools:
        if not shutil.which(tool):
            return "needs %s" % tool
    p = sh("ip", "netns", "add", tag + "probe", check=False)
    if p.returncode != 0:
        return "cannot create a network namespace: " + p.stderr.strip()
    sh("ip", "netns", "del", tag + "probe", check=False)
    return None


class BridgedHosts:
    def __init__(self, tag, n, net, iface):
        self.hosts = ["%sh%d" % (tag, i) for i in range(n)]
        self.switch = tag + "sw"
        self.addr = ["%s.%d" % (net, i + 1) for i in range(n)]
        self.iface = iface
        # Interface names have at most 15 characters: keep tags short.
        self.host_end = ["%sa%d" % (tag, i) for i in range(n)]
        self.switch_end = ["%sb%d" % (tag, i) for i in range(n)]

    def setup(self):
        sw = self.switch
        sh("ip", "netns", "add", sw)
        sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "link", "add", self.host_end[i], "type", "veth", "peer", "name",
               self.switch_end[i])
            sh("ip", "link", "set", self.host_end[i], "netns", ns)
            sh("ip", "-n", ns, "link", "set", self.host_end[i], "name", self.iface)
            sh("ip", "-n", ns, "addr", "add", self.addr[i] + "/24", "dev", self.iface)
            sh("ip", "-n", ns, "link", "set", self.iface, "up")
            sh("ip", "link", "set", self.switch_end[i], "netns", sw)
            sh("ip", "-n", sw, "link", "set", self.switch_end[i], "master", "br0")
            sh("ip", "-n", sw, "link", "set", self.switch_end[i], "up")

    def teardown(self):
        # Deleting a namespace deletes the veth ends inside it (and so their
        # peers); an end still in the root namespace (setup failed half-way)
        # is deleted by name.
        for ns in self.hosts + [self.switch]:
            sh("ip", "netns", "del", ns, check=False)
        for dev in self.host_end + self.switch_end:
            sh("ip", "link", "del", dev, check=False)

    def command(self, host, inner):
        """inner run on host `host` under its own host name, host<host> (a
        UTS namespace of its own; `ip netns exec`, unshare and sh all exec in
        place, so the process is ddpdiag itself)."""
        script = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", self.hosts[host], "unshare", "--uts", "sh", "-c", script,
                "host%d" % host] + inner


def finish(p, timeout):
    """(returncode, stdout, stderr) of p; kills it past timeout and fails."""
    try:
        so, se = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        so, se = p.communicate()
        raise AssertionError("rank did not end in %.0f s:\n%s" % (timeout, se))
    return p.returncode, so, se
