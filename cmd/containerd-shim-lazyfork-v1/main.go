// Command containerd-shim-lazyfork-v1 is the binary containerd runs for the
// runtime io.containerd.lazyfork.v1: a small front to the full shim,
// containerd-shim-lazyfork-v1-full, found in the same directory.
//
// containerd runs `containerd-shim-lazyfork-v1 ... start` for every task it
// creates, and for the forks of one batch, which share one shim
// (lazyfork.io/shim-group), that run only finds the shim already serving the
// group. The front answers exactly that case itself: it computes the group
// and the socket address as the full shim's manager does (package
// internal/shimaddr, the same start lock and spec rewrite), connects, and if
// the shim answers prints the bootstrap result the full shim would print.
// Everything else (a start that needs a new shim, delete, -info, -v, the OCI
// hook, the shim daemon) is the full shim, executed in place of the front
// with the same arguments, environment, standard input and directory.
//
// It links no containerd, grpc or protobuf package: a served start takes
// 2-4 ms where the full shim takes 9-15 ms; a command it hands on pays its
// start-up, about 1.5 ms, before the full shim's.
package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/shimaddr"
)

// FullName is the full shim binary, beside the front.
const FullName = "containerd-shim-lazyfork-v1-full"

// madvguardServeEnv is madvguard.ServeEnv: set, the process is the full
// shim's madvise supervisor (a test holds them equal).
const madvguardServeEnv = "LAZYFORK_MADVGUARD_SUPERVISE"

// maxInput is what the full shim reads of the bootstrap parameters
// (containerd's pkg/shim: 10 MiB).
const maxInput = 10 << 20

// connectTimeout is containerd's pkg/shim CanConnect's dial timeout.
const connectTimeout = 100 * time.Millisecond

func main() {
	var input []byte
	var env []string
	if a, ok := parseArgs(os.Args[1:]); ok && a.action == "start" && os.Getenv(madvguardServeEnv) == "" {
		var err error
		input, err = io.ReadAll(io.LimitReader(os.Stdin, maxInput))
		if err == nil {
			out, held, ok := start(a, input)
			if ok {
				if _, err := os.Stdout.Write(out); err != nil {
					fmt.Fprintf(os.Stderr, "%s: write the bootstrap result: %s", filepath.Base(os.Args[0]), err)
					os.Exit(1)
				}
				return
			}
			if held != nil {
				// Held until the full shim has started the group's shim:
				// the group's other starts then find it running.
				if kv, err := held.Handoff(); err == nil {
					env = append(os.Environ(), kv)
				} else {
					held.Release()
				}
			}
		}
	}
	execFull(input, env)
}

// args are the flags containerd's pkg/shim parses, as far as the front needs
// them.
type args struct {
	namespace, id, address string
	action                 string
}

// parseArgs parses argv as the full shim's flag set would; ok is false when
// the front leaves the command to the full shim (an unknown flag, -v, -info,
// no namespace).
func parseArgs(argv []string) (a args, ok bool) {
	for i := 0; i < len(argv); i++ {
		s := argv[i]
		if len(s) < 2 || s[0] != '-' {
			a.action = s
			break
		}
		if s == "--" {
			if i+1 < len(argv) {
				a.action = argv[i+1]
			}
			break
		}
		name := strings.TrimPrefix(s[1:], "-")
		value, hasValue := "", false
		if k, v, found := strings.Cut(name, "="); found {
			name, value, hasValue = k, v, true
		}
		switch name {
		case "debug":
			if hasValue && value != "true" && value != "false" && value != "1" && value != "0" {
				return a, false
			}
		case "namespace", "id", "socket", "debug-socket", "bundle", "address", "publish-binary":
			if !hasValue {
				if i+1 == len(argv) {
					return a, false
				}
				i++
				value = argv[i]
			}
			switch name {
			case "namespace":
				a.namespace = value
			case "id":
				a.id = value
			case "address":
				a.address = value
			}
		default: // -v, -version, -info, -h, or what the full shim rejects
			return a, false
		}
	}
	return a, a.namespace != ""
}

// start answers `start` when the shim of the container's group runs: the
// bootstrap result to print, and true. false leaves the start to the full
// shim (a new shim, or anything unexpected: the full shim decides and says
// what is wrong); held is then the group's start lock, still held, if the
// front took it.
func start(a args, input []byte) (out []byte, held *shimaddr.Lock, ok bool) {
	p, err := decodeParams(input)
	if err != nil || len(input) == 0 || p.instanceID != a.id || p.namespace != a.namespace {
		return nil, nil, false
	}
	spec, err := shimaddr.ReadSpec(".")
	if err != nil {
		return nil, nil, false
	}
	socketDir := shimaddr.SocketDir(p.socketDir)
	group, rewrite := spec.ShimGroup()
	grouping := group
	var lock *shimaddr.Lock
	if group == "" {
		grouping = shimaddr.Grouping(p.instanceID, spec.Annotations)
	} else if lock, err = shimaddr.LockStart(socketDir, group); err != nil {
		return nil, nil, false
	}
	address := shimaddr.Address(socketDir, p.grpcAddress, a.namespace, grouping, false)
	if !canConnect(address) {
		return nil, lock, false
	}
	if lock != nil {
		defer lock.Release()
	}
	if rewrite {
		if err := spec.SetRuncGroup(group); err != nil {
			return nil, nil, false
		}
	}
	if p.socketDir != "" {
		if err := writeSocketDir(p.socketDir); err != nil {
			return nil, nil, false
		}
	}
	return encodeResult(address), nil, true
}

// canConnect is containerd's pkg/shim CanConnect for a unix:// address: a
// shim accepts connections there.
func canConnect(address string) bool {
	path, ok := strings.CutPrefix(address, "unix://")
	if !ok {
		return false
	}
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer syscall.Close(fd)
	// A full accept queue makes a blocking connect wait up to the send
	// timeout, as containerd's dial waits up to its timeout.
	tv := syscall.NsecToTimeval(connectTimeout.Nanoseconds())
	if err := syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_SNDTIMEO, &tv); err != nil {
		return false
	}
	return syscall.Connect(fd, &syscall.SockaddrUnix{Name: path}) == nil
}

// socketDirLink is containerd's pkg/shim link, in the bundle, to the socket
// directory: the shim daemon reads it to remove its sockets.
const socketDirLink = "s"

// writeSocketDir is containerd's pkg/shim writeSocketDir, which the full
// shim runs before every start.
func writeSocketDir(dir string) error {
	if _, err := os.Lstat(socketDirLink); err == nil {
		if err := os.Remove(socketDirLink); err != nil {
			return err
		}
	}
	return os.Symlink(dir, socketDirLink)
}

// execFull replaces the front with the full shim, same arguments,
// environment (env, when not nil) and directory. input is what the front read
// of standard input: the full shim reads it again from a memory file.
func execFull(input []byte, env []string) {
	fail := func(err error) {
		fmt.Fprintf(os.Stderr, "%s: %s", filepath.Base(os.Args[0]), err)
		os.Exit(1)
	}
	self, err := os.Executable()
	if err != nil {
		fail(fmt.Errorf("locate the full shim %s: %w", FullName, err))
	}
	full := filepath.Join(filepath.Dir(self), FullName)
	if input != nil {
		if err := refillStdin(input); err != nil {
			fail(fmt.Errorf("hand the bootstrap parameters to the full shim %s: %w", full, err))
		}
	}
	if env == nil {
		env = os.Environ()
	}
	err = syscall.Exec(full, os.Args, env)
	fail(fmt.Errorf("run the full shim %s (install it beside %s): %w", full, self, err))
}

// refillStdin makes standard input a memory file holding data, at offset 0.
func refillStdin(data []byte) error {
	fd, err := unix.MemfdCreate("bootstrap", 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	for b := data; len(b) > 0; {
		n, err := unix.Write(fd, b)
		if err != nil {
			return err
		}
		b = b[n:]
	}
	if _, err := unix.Seek(fd, 0, io.SeekStart); err != nil {
		return err
	}
	return unix.Dup3(fd, 0, 0)
}
