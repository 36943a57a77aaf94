// Package shimspawn starts a shim daemon exactly as containerd 2.4's runc
// manager does for `shim start` (cmd/containerd-shim-runc-v2/manager Start,
// newCommand, newShimSocket, and pkg/shim's NewSocket, CanConnect,
// RemoveSocket, AdjustOOMScore): the daemon is the full shim binary with
// `-namespace NS -id ID -address ADDR [-debug]`, run in the bundle with the
// start's environment plus GOMAXPROCS=4 and OTEL_SERVICE_NAME, in a process
// group of its own, its listening socket as descriptor 3 (and the debug
// socket as 4 when containerd logs at debug level), its OOM score one above
// containerd's; the start does not wait for it.
//
// It leaves out what runc's manager does only on request: joining a shim
// cgroup (runc's Options.ShimCgroup) and core scheduling (SCHED_CORE). A
// caller with either hands the start to runc's manager (the full shim).
// Tests hold the daemon's command line, environment, descriptors and socket,
// and the start's answer, equal to runc's manager's.
//
// It imports the standard library and internal/shimaddr only: the front
// binary (cmd/containerd-shim-lazyfork-v1) links no containerd, grpc,
// protobuf, nor package net (which would pull in cgo).
package shimspawn

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/lazyfork/lazyfork/internal/shimaddr"
)

// Params are the fields of containerd's bootstrap parameters a start uses.
type Params struct {
	ID, Namespace string
	GRPCAddress   string
	// SocketDir is where the shim sockets go: shimaddr.SocketDir of the
	// parameters' socket_dir.
	SocketDir string
	// Debug is runc's debugLog: the log level is debug or trace.
	Debug bool
}

// Spawned is a start's outcome.
type Spawned struct {
	// Address is the shim's socket, for the bootstrap result.
	Address string
	// Running reports that the group's shim already served that socket: no
	// daemon was started.
	Running bool
	// Pid is the daemon started, 0 when Running.
	Pid int
}

// Error is a start that failed after its daemon was started: the daemon was
// killed and its sockets removed, as runc's manager does. Any other error
// of Spawn left no daemon.
type Error struct{ Err error }

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

// Spawn is runc's manager's Start for the container params.ID of the shim
// group grouping (shimaddr.PrepareStart's Grouping), with self the shim
// binary to run (runc's os.Executable(): the full shim), in the current
// directory (the bundle).
func Spawn(self string, p Params, grouping string) (_ Spawned, retErr error) {
	cmd, err := Command(self, p.Namespace, p.ID, p.GRPCAddress, p.Debug)
	if err != nil {
		return Spawned{}, err
	}
	var sockets []*Socket
	defer func() {
		if retErr != nil {
			for _, s := range sockets {
				s.Close()
			}
		}
	}()
	s, err := NewShimSocket(p.SocketDir, p.GRPCAddress, p.Namespace, grouping, false)
	if err != nil {
		if errors.Is(err, ErrRunning) {
			return Spawned{Address: s.Address, Running: true}, nil
		}
		return Spawned{}, err
	}
	sockets = append(sockets, s)
	cmd.ExtraFiles = append(cmd.ExtraFiles, s.File)
	if p.Debug {
		s, err := NewShimSocket(p.SocketDir, p.GRPCAddress, p.Namespace, grouping, true)
		if err != nil {
			return Spawned{}, err
		}
		sockets = append(sockets, s)
		cmd.ExtraFiles = append(cmd.ExtraFiles, s.File)
	}
	if err := cmd.Start(); err != nil {
		return Spawned{}, err
	}
	if err := AdjustOOMScore(cmd.Process.Pid); err != nil {
		cmd.Process.Kill()
		return Spawned{}, &Error{fmt.Errorf("failed to adjust OOM score for shim: %w", err)}
	}
	return Spawned{Address: sockets[0].Address, Pid: cmd.Process.Pid}, nil
}

// Command is runc's manager's newCommand: the shim daemon's command, not
// started. ns must be a valid containerd identifier (namespaces.NamespaceRequired).
func Command(self, ns, id, grpcAddress string, debug bool) (*exec.Cmd, error) {
	if ns == "" {
		return nil, errors.New("namespace is required")
	}
	if !shimaddr.ValidIdentifier(ns) {
		return nil, fmt.Errorf("namespace validation: invalid identifier %q", ns)
	}
	cwd, err := os.Getwd()
	if err != nil {
		return nil, err
	}
	args := []string{
		"-namespace", ns,
		"-id", id,
		"-address", grpcAddress,
	}
	if debug {
		args = append(args, "-debug")
	}
	cmd := exec.Command(self, args...)
	cmd.Dir = cwd
	cmd.Env = append(os.Environ(), "GOMAXPROCS=4")
	cmd.Env = append(cmd.Env, "OTEL_SERVICE_NAME=containerd-shim-"+id)
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Setpgid: true,
	}
	return cmd, nil
}

// ErrRunning is NewShimSocket's answer where a shim already serves the
// socket (runc's manager: errdefs.ErrAlreadyExists).
var ErrRunning = errors.New("shim socket already served")

// Socket is a shim socket listening, for the daemon to inherit: runc's
// manager's shimSocket.
type Socket struct {
	Address string
	File    *os.File // the listening socket; nil when a shim already serves it
}

// Close closes the socket and removes it.
func (s *Socket) Close() {
	if s.File != nil {
		s.File.Close()
	}
	RemoveSocket(s.Address)
}

// NewShimSocket is runc's manager's newShimSocket: the socket of grouping's
// shim (debug: its debug socket), listening; where one already exists, the
// socket of the shim that serves it (with ErrRunning), or a fresh one in
// place of a stale one.
func NewShimSocket(socketDir, grpcAddress, ns, grouping string, debug bool) (*Socket, error) {
	address := shimaddr.Address(socketDir, grpcAddress, ns, grouping, debug)
	f, err := NewSocket(address)
	if err != nil {
		if !errors.Is(err, syscall.EADDRINUSE) {
			return nil, fmt.Errorf("create new shim socket: %w", err)
		}
		if !debug && CanConnect(address) {
			return &Socket{Address: address}, ErrRunning
		}
		if err := RemoveSocket(address); err != nil {
			return nil, fmt.Errorf("remove pre-existing socket: %w", err)
		}
		if f, err = NewSocket(address); err != nil {
			return nil, fmt.Errorf("try create new shim socket 2x: %w", err)
		}
	}
	return &Socket{Address: address, File: f}, nil
}

// socketPath is the file of a unix:// address; ok is false for any other
// (pkg/shim takes those for abstract sockets, which LazyFork never gets:
// shimaddr.Address is always unix://).
func socketPath(address string) (string, bool) {
	return strings.CutPrefix(address, "unix://")
}

// NewSocket is pkg/shim's NewSocket for a unix:// address, as net.Listen
// makes it (package net is not linked): its directory made 0700, the
// socket bound (SO_REUSEADDR set, as net sets it) and listening with the
// system's backlog, then made 0600. It returns the listening socket in
// blocking mode, as the daemon receives it from runc's manager (os/exec
// makes the descriptors it passes blocking).
func NewSocket(address string) (*os.File, error) {
	path, ok := socketPath(address)
	if !ok {
		return nil, fmt.Errorf("shim socket %q: not a unix:// address", address)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("mkdir failed for %s: %w", path, err)
	}
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, listenError(path, os.NewSyscallError("socket", err))
	}
	if err := syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1); err != nil {
		syscall.Close(fd)
		return nil, listenError(path, os.NewSyscallError("setsockopt", err))
	}
	if err := syscall.Bind(fd, &syscall.SockaddrUnix{Name: path}); err != nil {
		syscall.Close(fd)
		return nil, listenError(path, os.NewSyscallError("bind", err))
	}
	if err := syscall.Listen(fd, listenerBacklog()); err != nil {
		syscall.Close(fd)
		return nil, listenError(path, os.NewSyscallError("listen", err))
	}
	if err := os.Chmod(path, 0o600); err != nil {
		os.Remove(path)
		syscall.Close(fd)
		return nil, fmt.Errorf("chmod failed for %s: %w", path, err)
	}
	return os.NewFile(uintptr(fd), "socket"), nil
}

func listenError(path string, err error) error {
	return fmt.Errorf("listen unix %s: %w", path, err)
}

// listenerBacklog is package net's listen backlog on Linux: somaxconn,
// capped as net caps it.
func listenerBacklog() int {
	b, err := os.ReadFile("/proc/sys/net/core/somaxconn")
	if err != nil {
		return syscall.SOMAXCONN
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return syscall.SOMAXCONN
	}
	n, err := strconv.Atoi(f[0])
	if n <= 0 || err != nil {
		return syscall.SOMAXCONN
	}
	if n > 1<<16-1 {
		// net: 2^32-1 from Linux 4.1, which LazyFork requires anyway.
		if uint(n) > 1<<32-1 {
			n = 1<<32 - 1
		}
	}
	return n
}

// RemoveSocket is pkg/shim's RemoveSocket for a unix:// address.
func RemoveSocket(address string) error {
	if path, ok := socketPath(address); ok {
		return os.Remove(path)
	}
	return nil
}

// connectTimeout is pkg/shim CanConnect's dial timeout.
const connectTimeout = 100 * time.Millisecond

// CanConnect is pkg/shim's CanConnect for a unix:// address: a shim
// accepts connections there.
func CanConnect(address string) bool {
	path, ok := socketPath(address)
	if !ok {
		return false
	}
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer syscall.Close(fd)
	// A full accept queue makes a blocking connect wait up to the send
	// timeout. Here this differs from containerd's dial, which fails at once
	// on a full queue (EAGAIN) and so takes a busy shim's socket for a stale
	// one; waiting is the safer answer.
	tv := syscall.NsecToTimeval(connectTimeout.Nanoseconds())
	if err := syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_SNDTIMEO, &tv); err != nil {
		return false
	}
	return syscall.Connect(fd, &syscall.SockaddrUnix{Name: path}) == nil
}

// OOM score adjustment bounds (the kernel's OOM_SCORE_ADJ_MIN, _MAX).
const (
	oomScoreAdjMin = -1000
	oomScoreAdjMax = 1000
)

// AdjustOOMScore is pkg/shim's AdjustOOMScore: the OOM score adjustment of
// process pid set one above this process's parent's (containerd's), within
// the kernel's bounds. Unlike containerd's, it does not excuse a refused
// write where the process is unprivileged or in a user namespace:
// OOMScoreExact says where the two agree.
func AdjustOOMScore(pid int) error {
	score, err := oomScoreAdj(os.Getppid())
	if err != nil {
		return fmt.Errorf("get parent OOM score: %w", err)
	}
	score = min(max(score+1, oomScoreAdjMin), oomScoreAdjMax)
	f, err := os.OpenFile("/proc/"+strconv.Itoa(pid)+"/oom_score_adj", os.O_WRONLY, 0)
	if err == nil {
		_, err = f.WriteString(strconv.Itoa(score))
		f.Close()
	}
	if err != nil {
		return fmt.Errorf("set shim OOM score: %w", err)
	}
	return nil
}

func oomScoreAdj(pid int) (int, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/oom_score_adj")
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

// procUserInitIno is the inode of the initial user namespace
// (PROC_USER_INIT_INO).
const procUserInitIno = 0xEFFFFFFD

// OOMScoreExact reports whether AdjustOOMScore does what containerd's does
// here: this process is privileged and in the initial user namespace, where
// containerd excuses no refused write either.
func OOMScoreExact() bool {
	var st syscall.Stat_t
	return syscall.Geteuid() == 0 && syscall.Stat("/proc/self/ns/user", &st) == nil && st.Ino == procUserInitIno
}
