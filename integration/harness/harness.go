package harness

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/hwbreak"
)

// Options configure a private containerd. The zero value runs plain runc without CRI.
type Options struct {
	// Containerd is the daemon binary; "" means `containerd` from PATH.
	Containerd string
	// BinDirs are prepended to containerd's PATH, e.g. the directory holding
	// containerd-shim-lazyfork-v1 (and the full shim it runs,
	// containerd-shim-lazyfork-v1-full).
	BinDirs []string
	// Env is added to containerd's environment (KEY=VALUE); shims inherit it.
	Env []string
	// EnableCRI turns on containerd's CRI plugin with private CNI dirs.
	EnableCRI bool
	// Runtimes are extra CRI runtime handlers (only used with EnableCRI).
	Runtimes []Runtime
	// ProxyPlugins are extra [proxy_plugins] entries.
	ProxyPlugins []ProxyPlugin
	// HostsDir is the registry configuration root (hosts.toml per registry
	// host, see WriteHostsDir): config_path of the transfer service and, with
	// EnableCRI, of CRI's image service.
	HostsDir string
	// ExtraTOML is appended verbatim to the generated config.
	ExtraTOML string
	// Debug sets containerd's log level to debug (also LAZYFORK_HARNESS_DEBUG=1).
	// LAZYFORK_HARNESS_KEEP_LOG=FILE copies containerd's log (shims included) to FILE on Stop.
	Debug bool
	// StartTimeout bounds the wait for the daemon to answer; 0 means 30 s.
	StartTimeout time.Duration
}

// Containerd is a running private containerd. Its exported fields are read-only.
type Containerd struct {
	// ID is unique per harness; Namespace and CgroupParent derive from it.
	ID string
	// Dir holds everything: root, state, sockets, logs, runc root, temp dirs.
	Dir   string
	Root  string
	State string
	// Address is containerd's gRPC socket.
	Address string
	// Namespace is the containerd namespace the harness's helpers use.
	Namespace string
	// ShimSocketDir is the shim manager's private socket dir.
	ShimSocketDir string
	// RuncRoot is the private runc state root of containers made by NewContainer.
	RuncRoot string
	// CgroupParent is the cgroup (as in linux.cgroupsPath) all containers go under.
	CgroupParent string
	// LogPath is containerd's own log file.
	LogPath string
	// FIFODir is for tasks created with FIFO-based IO instead of NewTask's log
	// files: pass cio.WithFIFODir(c.FIFODir) so nothing lands in /run/containerd.
	FIFODir string

	opts    Options
	cmd     *exec.Cmd
	exited  chan struct{} // closed when the daemon process exits
	waitErr error         // set before exited is closed

	mu     sync.Mutex
	client *client.Client // guarded by mu
	closed bool           // guarded by mu
}

// Start runs a private containerd and waits until it answers. On error nothing is
// left behind.
func Start(ctx context.Context, opts Options) (_ *Containerd, retErr error) {
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("harness: containerd needs root: %w", errdefs.ErrFailedPrecondition)
	}
	bin := opts.Containerd
	if bin == "" {
		p, err := exec.LookPath("containerd")
		if err != nil {
			return nil, fmt.Errorf("harness: containerd not on PATH (run `make deps`): %w", errdefs.ErrNotFound)
		}
		bin = p
	}
	if os.Getenv("LAZYFORK_HARNESS_DEBUG") == "1" {
		opts.Debug = true
	}
	id, err := randomID()
	if err != nil {
		return nil, err
	}
	// Leftovers of crashed runs first (only of owners that are gone).
	_ = ReapOrphans(ctx, "")
	// A short base keeps socket paths far below the 108-byte limit and the shim
	// socket dir below containerd's 42-character limit.
	dir, err := os.MkdirTemp(baseDir(), "lfh-"+id+"-")
	if err != nil {
		return nil, fmt.Errorf("harness: temp dir: %w", err)
	}
	c := layout(id, dir)
	c.opts = opts
	defer func() {
		if retErr != nil {
			_ = c.Stop()
		}
	}()
	if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(selfIdentity()+"\n"), 0o600); err != nil {
		return nil, fmt.Errorf("harness: %w", err)
	}
	if err := mountVolatile(filepath.Join(dir, volatileDir)); err != nil {
		return nil, err
	}
	if len(c.ShimSocketDir) > 42 {
		return nil, fmt.Errorf("harness: shim socket dir %q longer than 42 bytes: %w", c.ShimSocketDir, errdefs.ErrInvalidArgument)
	}
	for _, d := range []string{c.Root, c.State, c.ShimSocketDir, c.RuncRoot, filepath.Join(dir, "logs"),
		filepath.Join(dir, "cni", "net.d"), filepath.Join(dir, "cni", "bin"), filepath.Join(dir, "opt"), c.FIFODir,
		c.runtimeDir()} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("harness: %w", err)
		}
	}
	if opts.EnableCRI {
		// A pod with its own user namespace (hostUsers: false) reaches its
		// rootfs as its mapped root: the path must be traversable, as
		// containerd's own /run/containerd (0711) is.
		for _, d := range []string{dir, filepath.Dir(c.State), c.State} {
			if err := os.Chmod(d, 0o711); err != nil {
				return nil, fmt.Errorf("harness: %w", err)
			}
		}
	}
	cfgPath := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(cfgPath, []byte(c.config()), 0o600); err != nil {
		return nil, fmt.Errorf("harness: write config: %w", err)
	}
	logf, err := os.OpenFile(c.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("harness: %w", err)
	}
	defer logf.Close()

	cmd := exec.Command(bin, "--config", cfgPath)
	cmd.Dir = dir
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.Env = c.daemonEnv()
	// Its own process group: a ^C aimed at `go test` must not kill the daemon
	// before the teardown has used it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		close(c.exited)
		return nil, fmt.Errorf("harness: start containerd: %w", err)
	}
	c.cmd = cmd
	go func() {
		c.waitErr = cmd.Wait()
		close(c.exited)
	}()

	timeout := opts.StartTimeout
	if timeout == 0 {
		timeout = 30 * time.Second
	}
	if err := c.waitServing(ctx, timeout); err != nil {
		return nil, err
	}
	return c, nil
}

// runtimeDir is the daemon's XDG_RUNTIME_DIR (daemonEnv).
func (c *Containerd) runtimeDir() string { return filepath.Join(c.Dir, "xdg") }

func (c *Containerd) daemonEnv() []string {
	var env []string
	path := os.Getenv("PATH")
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "PATH=") {
			env = append(env, kv)
		}
	}
	var dirs []string
	for _, d := range c.opts.BinDirs {
		// containerd runs in c.Dir: a relative dir would resolve there.
		if a, err := filepath.Abs(d); err == nil {
			d = a
		}
		dirs = append(dirs, d)
	}
	if path != "" {
		dirs = append(dirs, path)
	}
	// containerd, runc and criu live in /usr/local; make sure a minimal PATH
	// (e.g. sudo's secure_path) still finds them.
	for _, d := range []string{"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"} {
		if !strings.Contains(":"+path+":", ":"+d+":") {
			dirs = append(dirs, d)
		}
	}
	env = append(env, "PATH="+strings.Join(dirs, ":"))
	// containerd unpacks a task's checkpoint (nerdctl start --checkpoint)
	// into a directory under $XDG_RUNTIME_DIR, else /tmp, and never removes
	// it: this stack's go with its directory. As root, runc and CRIU do not
	// read it.
	env = append(env, "XDG_RUNTIME_DIR="+c.runtimeDir())
	// runc.v2's CRIU runs too (the side-by-side tests and benchmarks): on a
	// host whose breakpoints do not trap, CRIU would hang (hwbreak).
	env = hwbreak.CRIUEnv(env)
	for _, r := range c.opts.Runtimes {
		if r.NoOptions {
			// No [options] to name the private runc root: the LazyFork shim
			// takes it from its environment (shim.Config.RuncRoot).
			env = append(env, "LAZYFORK_RUNC_ROOT="+c.RuncRoot)
			break
		}
	}
	return append(env, c.opts.Env...)
}

func (c *Containerd) waitServing(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		select {
		case <-c.exited:
			return fmt.Errorf("harness: containerd exited at start (%v); log:\n%s", c.waitErr, c.Log())
		case <-ctx.Done():
			return ctx.Err()
		default:
		}
		if _, err := os.Stat(c.Address); err == nil {
			cl, err := client.New(c.Address, client.WithDefaultNamespace(c.Namespace), client.WithTimeout(2*time.Second))
			if err == nil {
				sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				ok, err := cl.IsServing(sctx)
				cancel()
				if err == nil && ok {
					c.mu.Lock()
					c.client = cl
					c.mu.Unlock()
					return nil
				}
				cl.Close()
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("harness: containerd did not answer within %v: %w; log:\n%s", timeout, context.DeadlineExceeded, c.Log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Client returns the client connected to this containerd (default namespace
// c.Namespace). Do not Close it; Stop does.
func (c *Containerd) Client() *client.Client {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.client
}

// Context returns ctx carrying the harness's namespace unless it already has one.
func (c *Containerd) Context(ctx context.Context) context.Context {
	if _, ok := namespaces.Namespace(ctx); ok {
		return ctx
	}
	return namespaces.WithNamespace(ctx, c.Namespace)
}

// CollectGarbage runs containerd's garbage collector and waits for it (a
// lease deleted with SynchronousDelete does): what nothing references is
// gone when it returns. The scheduled collections are not enough for a
// test that waits for something to go: the scheduler drops a deletion it
// hears of while a collection runs, and collects it only after the next
// mutation.
func (c *Containerd) CollectGarbage(ctx context.Context) error {
	ls := c.Client().LeasesService()
	l, err := ls.Create(c.Context(ctx), leases.WithRandomID())
	if err != nil {
		return err
	}
	return ls.Delete(c.Context(ctx), l, leases.SynchronousDelete)
}

// Log returns containerd's log so far.
func (c *Containerd) Log() string {
	b, err := os.ReadFile(c.LogPath)
	if err != nil {
		return fmt.Sprintf("(no containerd log: %v)", err)
	}
	return string(b)
}

// TempDir makes a fresh directory under the harness dir (removed by Stop).
func (c *Containerd) TempDir(pattern string) (string, error) {
	return os.MkdirTemp(c.Dir, pattern)
}

// Stop tears everything down (see the package doc). It is idempotent; it returns
// the joined errors of the steps that failed but always runs every step.
func (c *Containerd) Stop() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	cl := c.client
	c.client = nil
	c.mu.Unlock()

	var errs []error
	if cl != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		var sns []string
		for _, p := range c.opts.ProxyPlugins {
			if p.Type == "" || p.Type == "snapshot" {
				sns = append(sns, p.Name)
			}
		}
		errs = append(errs, removeAll(ctx, cl, sns))
		cancel()
		cl.Close()
	}
	errs = append(errs, c.stopDaemon())
	errs = append(errs, killShims(c.Address))
	errs = append(errs, removeCgroups(c.CgroupParent))
	errs = append(errs, unmountUnder(c.Dir))
	if keep := os.Getenv("LAZYFORK_HARNESS_KEEP_LOG"); keep != "" {
		// Debugging a benchmark or test: the log (shims' lines included) outlives the run.
		if b, err := os.ReadFile(c.LogPath); err == nil {
			errs = append(errs, os.WriteFile(keep, b, 0o600))
		}
	}
	if err := os.RemoveAll(c.Dir); err != nil {
		errs = append(errs, fmt.Errorf("harness: remove %s: %w", c.Dir, err))
	}
	// runc keeps the state of containers made without a runc Root option
	// (the CLI's) in its default root, by namespace, whatever containerd's
	// state dir is: the harness's namespace is its own.
	runcDefault := filepath.Join("/run/containerd/runc", c.Namespace)
	errs = append(errs, unmountUnder(runcDefault))
	if err := os.RemoveAll(runcDefault); err != nil {
		errs = append(errs, fmt.Errorf("harness: remove %s: %w", runcDefault, err))
	}
	return errors.Join(errs...)
}

func (c *Containerd) stopDaemon() error {
	if c.cmd == nil || c.cmd.Process == nil {
		// Reaped harness: not our child, find the daemon by its config path.
		for _, pid := range pidsWithArgs("--config", filepath.Join(c.Dir, "config.toml")) {
			_ = syscall.Kill(pid, syscall.SIGTERM)
			if !waitGone(pid, 10*time.Second) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
				if !waitGone(pid, 10*time.Second) {
					return fmt.Errorf("harness: containerd pid %d does not die", pid)
				}
			}
		}
		return nil
	}
	select {
	case <-c.exited:
		return nil
	default:
	}
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.exited:
		return nil
	case <-time.After(10 * time.Second):
	}
	_ = c.cmd.Process.Kill()
	select {
	case <-c.exited:
		return nil
	case <-time.After(10 * time.Second):
		return fmt.Errorf("harness: containerd pid %d does not die", c.cmd.Process.Pid)
	}
}

// Reap tears down the leftovers of a harness whose process died without Stop
// (a crashed or killed test): dir is its Dir, e.g. /tmp/lfh-0f4a35d1-940176563.
// It is `Stop` for a harness this process did not start.
func Reap(ctx context.Context, dir string) error {
	dir = filepath.Clean(dir)
	base := filepath.Base(dir)
	parts := strings.Split(base, "-")
	if len(parts) != 3 || parts[0] != "lfh" || len(parts[1]) != 8 {
		return fmt.Errorf("harness: %s is not a harness dir (lfh-ID-N): %w", dir, errdefs.ErrInvalidArgument)
	}
	id := parts[1]
	c := layout(id, dir)
	if len(pidsWithArgs("--config", filepath.Join(dir, "config.toml"))) > 0 {
		cl, err := client.New(c.Address, client.WithDefaultNamespace(c.Namespace), client.WithTimeout(5*time.Second))
		if err == nil {
			c.client = cl
		}
	}
	return c.Stop()
}

// volatileDir is the harness dir's tmpfs (see mountVolatile).
const volatileDir = "run"

// layout is the harness of id in dir, its paths set and nothing started.
// What a host keeps in /run (containerd's state dir with its bundles, runc's
// root, the FIFOs) is on the harness's tmpfs; the sockets stay at the top,
// their paths short.
func layout(id, dir string) *Containerd {
	run := filepath.Join(dir, volatileDir)
	return &Containerd{
		ID:            id,
		Dir:           dir,
		Root:          filepath.Join(dir, "root"),
		State:         filepath.Join(run, "state"),
		Address:       filepath.Join(dir, "c.sock"),
		Namespace:     "lfh-" + id,
		ShimSocketDir: filepath.Join(dir, "s"),
		RuncRoot:      filepath.Join(run, "runc"),
		CgroupParent:  "/lfh-" + id,
		LogPath:       filepath.Join(dir, "containerd.log"),
		FIFODir:       filepath.Join(run, "fifo"),
		exited:        make(chan struct{}),
	}
}

// mountVolatile mounts a tmpfs at dir for the files a host keeps in /run.
// A task's start writes some twenty small files there (containerd's bundle,
// the shim's and runc's state, pid files, logs) and its delete removes them;
// on a disk filesystem that is the only cost of its kind in a fork, and on
// an ext4 without a journal (these test machines' root, /tmp and /run
// alike) each new inode is found by a scan past every inode deleted in the
// last seconds (ext4's recently_deleted): 100 forks at once spent 16% of the
// machine's time there (perf), where a host's /run is a tmpfs.
func mountVolatile(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("harness: %w", err)
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0700,size=1g"); err != nil {
		return fmt.Errorf("harness: mount a tmpfs at %s for the state dir: %w", dir, err)
	}
	return nil
}

func randomID() (string, error) {
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("harness: random id: %w", err)
	}
	return hex.EncodeToString(b), nil
}
