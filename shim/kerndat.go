package shim

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// CRIU keeps what it learns about the kernel (its "kerndat": page-map and
// dirty-tracking support, namespaces, netfilter modules loaded by running
// `iptables -L`, `ip6tables -L` and `iptables -w -L`...) in /run/criu.kdat,
// but only when /run is a tmpfs (the cache must not outlive a boot). Where
// /run is on a disk, every CRIU run probes again: runc's version check and
// each dump and restore pay 10-20 ms of probes and three iptables runs.
//
// CRIU reads the cache without checking where it lives, and only writes it
// to a tmpfs. So on such a host the shim makes the cache once per boot in
// LazyFork's own tmpfs (ROOT/criu-<criu binary>.kdat, by running criu in a
// private mount namespace whose /run is a fresh tmpfs) and points
// /run/criu.kdat at it with a symbolic link. The link is the only thing on
// the host's /run, and it undoes itself: when the tmpfs goes (reboot,
// `lazyfork setup --down --purge`) the link dangles, and the next CRIU run
// finds no cache, probes, fails to save on the disk and removes the link. A
// CRIU upgrade gets a new cache (the file is named after the binary), and a
// regular /run/criu.kdat (someone else's choice) is left alone.

// kerndatLink is where CRIU reads its kernel-feature cache (KDAT_RUNDIR of
// Debian's and upstream's builds).
var kerndatLink = "/run/criu.kdat"

// kerndatHelperArg is RunHook's subcommand that writes a fresh CRIU
// kernel-feature cache on stdout (see runKerndatHelper).
const kerndatHelperArg = "kerndat"

// kerndat makes sure, once per shim, that CRIU finds its cache.
type kerndat struct {
	once sync.Once
	done chan struct{}
}

// ensure starts the one check of this shim and, when wait is set, waits for it
// (a restore waits; a fresh container's create does not).
func (k *kerndat) ensure(ctx context.Context, root, self string, wait bool) {
	k.once.Do(func() {
		k.done = make(chan struct{})
		go func() {
			defer close(k.done)
			if err := ensureKerndatCache(root, self); err != nil {
				log.G(ctx).WithError(err).Warn("lazyfork: CRIU kernel-feature cache: CRIU probes the kernel on every run")
			}
		}()
	})
	if wait {
		<-k.done
	}
}

// ensureKerndatCache links kerndatLink to a cache in root when /run is not a
// tmpfs (see above). self is this binary (the helper that makes the cache).
func ensureKerndatCache(root, self string) error {
	runDir := filepath.Dir(kerndatLink)
	var fs unix.Statfs_t
	if err := unix.Statfs(runDir, &fs); err != nil {
		return fmt.Errorf("statfs %s: %w", runDir, err)
	}
	if fs.Type == unix.TMPFS_MAGIC {
		return nil // CRIU keeps its own cache there
	}
	criu, err := exec.LookPath("criu")
	if err != nil {
		return err
	}
	target, err := kerndatFile(root, criu)
	if err != nil {
		return err
	}
	if cur, err := os.Readlink(kerndatLink); err == nil {
		if cur == target {
			if _, err := os.Stat(target); err == nil {
				return nil
			}
		}
	} else if _, lerr := os.Lstat(kerndatLink); lerr == nil {
		return nil // a regular file: not ours to replace
	}
	if _, err := os.Stat(target); err != nil {
		b, err := makeKerndat(self)
		if err != nil {
			return err
		}
		if err := writeFileAtomic(target, b, 0o600); err != nil {
			return err
		}
	}
	// Replace the link in one step: CRIU runs of other shims may read it now.
	tmp := kerndatLink + ".lazyfork-" + strconv.Itoa(os.Getpid())
	_ = os.Remove(tmp)
	if err := os.Symlink(target, tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, kerndatLink); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// kerndatFile is the cache's path in root for the criu binary at path: named
// after the binary's size and modification time, so an upgraded CRIU gets
// its own (CRIU discards, and would keep re-reading, another build's cache).
func kerndatFile(root, criu string) (string, error) {
	st, err := os.Stat(criu)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256([]byte(fmt.Sprintf("%s %d %d", criu, st.Size(), st.ModTime().UnixNano())))
	return filepath.Join(root, "criu-"+hex.EncodeToString(sum[:8])+".kdat"), nil
}

// makeKerndat runs the helper in a new mount namespace and returns the cache
// it wrote.
func makeKerndat(self string) ([]byte, error) {
	cmd := exec.Command(self, HookArg, kerndatHelperArg)
	// Go makes the new namespace's mounts private before the helper runs.
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("make CRIU's kernel-feature cache: %w: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	if out.Len() == 0 {
		return nil, errors.New("make CRIU's kernel-feature cache: criu wrote none")
	}
	return out.Bytes(), nil
}

// runKerndatHelper is the helper (in its own mount namespace): a fresh tmpfs
// on /run, where `criu check` saves the cache, which goes to stdout.
func runKerndatHelper() error {
	runDir := filepath.Dir(kerndatLink)
	if err := unix.Mount("lazyfork-kdat", runDir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=1m"); err != nil {
		return fmt.Errorf("mount a tmpfs on %s: %w", runDir, err)
	}
	// Any command starts with the probes; this feature check is a short one.
	cmd := exec.Command("criu", "check", "--feature", "mnt_id", "-v0")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	_ = cmd.Run() // a missing feature is no matter: the cache is written first
	b, err := os.ReadFile(kerndatLink)
	if err != nil {
		return fmt.Errorf("criu saved no cache: %w", err)
	}
	_, err = os.Stdout.Write(b)
	return err
}
