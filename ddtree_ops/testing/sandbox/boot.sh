# Boots one sandbox host. Started by ddtree_ops.testing.sandbox (boot.py) as
#
#   ip netns exec NETNS unshare --mount --propagation private \
#       /bin/sh HOST_DIR/boot.sh HOST_DIR SITE_TREE SITE_PACKAGES SSHD
#
# so it runs in the host's own network and mount namespaces. It mounts the host's folders over
# the production paths (private mounts: the machine never sees them), starts the systemctl
# replacement's init loop (writing its PID to HOST_DIR/init.pid), then becomes sshd: ip, unshare
# and this exec replace one another, so the PID that started it is sshd's.
set -eu
if [ $# -ne 4 ]; then
    echo "usage: boot.sh HOST_DIR SITE_TREE SITE_PACKAGES SSHD" >&2
    exit 2
fi
H=$1
SITE_TREE=$2
SITE_PACKAGES=$3
SSHD=$4

mount --make-rprivate /
mount --bind "$H/etc-systemd-system" /etc/systemd/system
mount --bind "$H/var-log" /var/log
mount --bind "$H/var-lib" /var/lib
mount --bind "$H/opt" /opt
# site-packages: the cached wheel tree below (never written), this host's changes above.
mount -t overlay ddtree-site -o "lowerdir=$SITE_TREE,upperdir=$H/site-upper,workdir=$H/site-work" "$SITE_PACKAGES"
mount -t tmpfs -o mode=0755 ddtree-run /run
mkdir -p /run/sshd /run/systemd /run/lock /run/ddtree-sandbox /run/ddtree-sandbox/bin /run/ddtree-sandbox/gpu
cp "$H/bin/nvidia-smi" /run/ddtree-sandbox/bin/
cp "$H/ssh/ssh_host_ed25519_key" "$H/ssh/authorized_keys" "$H/ssh/sshd_config" /run/ddtree-sandbox/
chmod 600 /run/ddtree-sandbox/ssh_host_ed25519_key
# The machine's own units stay invisible; systemctl and journalctl are the replacement's. That
# includes its SysV scripts: the replacement's init loop would otherwise run /etc/init.d/ssh (the
# machine's sshd, its config and host key) whenever port 22 is free, e.g. while a test has this
# host's sshd stopped.
mount -t tmpfs -o mode=0755 ddtree-units /usr/lib/systemd/system
mount -t tmpfs -o mode=0755 ddtree-initd /etc/init.d
mount --bind "$H/bin/systemctl" /usr/bin/systemctl
mount --bind "$H/bin/journalctl" /usr/bin/journalctl
cd /
# The supervisor: starts the enabled units and restarts them per Restart=.
setsid systemctl -c InitLoopSleep=1 init </dev/null >/var/log/systemctl-init.log 2>&1 &
echo $! > "$H/init.pid"
exec "$SSHD" -D -e -f /run/ddtree-sandbox/sshd_config
