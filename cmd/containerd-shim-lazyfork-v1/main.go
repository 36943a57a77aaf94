// Command containerd-shim-lazyfork-v1 is the binary containerd runs for the
// runtime io.containerd.lazyfork.v1: a small front to the full shim,
// containerd-shim-lazyfork-v1-full, found in the same directory.
//
// containerd runs `containerd-shim-lazyfork-v1 ... start` for every task it
// creates. The front answers it itself: it computes the container's group,
// takes the group's start lock and rewrites the spec as the full shim's
// manager does (shimaddr.PrepareStart), and then either finds the group's
// shim already serving (the forks of one batch share one,
// lazyfork.io/shim-group) and prints its address, or starts the new shim
// daemon (the full binary) exactly as the full shim's `start` would, runc's
// manager's way (package internal/shimspawn), and prints its address.
//
// containerd also runs `delete` in a task's bundle after every task delete.
// Where the full shim's Delete RPC already deleted and released the task, it
// left the answer in the bundle (shimaddr.DeletedFile) and the front prints
// it, sparing a Go start and a `runc delete --force` that finds nothing.
//
// A start it cannot be sure to do alike (a shim cgroup in runc's options,
// SCHED_CORE, no privilege to set the OOM score as containerd's code does,
// anything unexpected) and everything else (any other delete, -info, -v, the
// OCI hook, the shim daemon) is the full shim, executed in place of the front
// with the same arguments, environment, standard input and directory.
//
// It links no containerd, grpc or protobuf package, nor package net: a start
// takes 2-4 ms of its own where the full shim takes 9-15 ms; a command it
// hands on pays its start-up, about 1.5 ms, before the full shim's.
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/shimaddr"
	"github.com/lazyfork/lazyfork/internal/shimspawn"
)

// FullName is the full shim binary, beside the front.
const FullName = "containerd-shim-lazyfork-v1-full"

// runtimeName is api.RuntimeName, the full shim's name in its errors (a
// test holds them equal; package api pulls in protobuf).
const runtimeName = "io.containerd.lazyfork.v1"

// madvguardServeEnv is madvguard.ServeEnv: set, the process is the full
// shim's madvise supervisor (a test holds them equal).
const madvguardServeEnv = "LAZYFORK_MADVGUARD_SUPERVISE"

// maxInput is what the full shim reads of the bootstrap parameters
// (containerd's pkg/shim: 10 MiB).
const maxInput = 10 << 20

func main() {
	var input []byte
	var env []string
	a, ok := parseArgs(os.Args[1:])
	ok = ok && os.Getenv(madvguardServeEnv) == ""
	if ok && a.action == "delete" {
		if out, done := deleted(a); done {
			if _, err := os.Stdout.Write(out); err != nil {
				fmt.Fprintf(os.Stderr, "%s: write the delete response: %s", filepath.Base(os.Args[0]), err)
				os.Exit(1)
			}
			return
		}
	}
	if ok && a.action == "start" {
		var err error
		input, err = io.ReadAll(io.LimitReader(os.Stdin, maxInput))
		if err != nil {
			// As pkg/shim fails: a part of the parameters must not pass
			// for the whole (a trailing field lost, such as the socket
			// directory, would still decode).
			fmt.Fprintf(os.Stderr, "%s: failed to read stdin: %s", runtimeName, err)
			os.Exit(1)
		}
		full, _ := fullPath()
		out, held, ok, err := start(a, input, full)
		if err != nil {
			// A new shim was started and killed: fail as the full
			// shim fails.
			fmt.Fprintf(os.Stderr, "%s: %s", runtimeName, err)
			os.Exit(1)
		}
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
	execFull(input, env)
}

// deleted answers `delete` for a task the full shim's Delete RPC already
// deleted and released (shimaddr.DeletedFile): containerd runs it in the
// task's bundle after every delete, and the full shim's would find nothing
// to do. false leaves the command to the full shim.
func deleted(a args) ([]byte, bool) {
	if !shimaddr.ValidIdentifier(a.id) {
		return nil, false
	}
	cwd, err := os.Getwd()
	if err != nil {
		return nil, false
	}
	// Where runc's manager finds the bundle.
	return shimaddr.ReadDeleted(filepath.Join(filepath.Dir(cwd), a.id))
}

// fullPath is the full shim binary as it finds itself (os.Executable: links
// resolved), the shim daemon the full shim's `start` would run.
func fullPath() (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	return filepath.EvalSymlinks(filepath.Join(filepath.Dir(self), FullName))
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

// start answers `start`: the bootstrap result to print, and true, where
// the shim of the container's group runs or where the front started it (the
// full shim, from full; "" starts none). false leaves the start to the full
// shim (a new shim the front cannot start alike, or anything unexpected:
// the full shim decides and says what is wrong); held is then the group's
// start lock, still held, if the front took it. An error is a start that
// failed after it started a shim daemon (and killed it): the full shim would
// fail alike, handing on would start a second one.
func start(a args, input []byte, full string) (out []byte, held *shimaddr.Lock, ok bool, err error) {
	p, err := decodeParams(input)
	if err != nil || len(input) == 0 || p.instanceID != a.id || p.namespace != a.namespace {
		return nil, nil, false, nil
	}
	socketDir := shimaddr.SocketDir(p.socketDir)
	st, err := shimaddr.PrepareStart(".", socketDir, p.instanceID)
	if err != nil {
		return nil, nil, false, nil
	}
	if full == "" || !canSpawn(p) {
		return served(a, p, st)
	}
	// As the full shim: pkg/shim links the socket directory, LazyFork's
	// manager writes the group, runc's manager starts the shim.
	if p.socketDir != "" {
		if err := writeSocketDir(p.socketDir); err != nil {
			return nil, st.Lock, false, nil
		}
	}
	if err := st.WriteGroup(); err != nil {
		return nil, st.Lock, false, nil
	}
	// The full shim's `start` catches these (pkg/shim setupSignals): a
	// daemon then gets them at their default action even where containerd
	// ran the start with one ignored, as from the full shim.
	signal.Notify(make(chan os.Signal, 1), unix.SIGTERM, unix.SIGINT, unix.SIGPIPE, unix.SIGCHLD)
	sp, err := shimspawn.Spawn(full, shimspawn.Params{
		ID:          p.instanceID,
		Namespace:   p.namespace,
		GRPCAddress: p.grpcAddress,
		SocketDir:   socketDir,
		Debug:       p.logLevel <= logLevelDebug,
	}, st.Grouping)
	if err != nil {
		var started *shimspawn.Error
		if errors.As(err, &started) {
			st.Release()
			return nil, nil, false, err
		}
		return nil, st.Lock, false, nil
	}
	// The new shim's socket listens (a connection waits for its accept):
	// the group's next start finds it.
	st.Release()
	return encodeResult(sp.Address), nil, true, nil
}

// canSpawn reports whether the front starts a new shim for these
// parameters exactly as runc's manager would: not where it would move the
// shim to a cgroup or set up core scheduling, nor where containerd's OOM
// score adjustment would excuse a refused write.
func canSpawn(p params) bool {
	return !p.shimCgroup && os.Getenv("SCHED_CORE") == "" && shimspawn.OOMScoreExact()
}

// served answers a start whose group's shim runs; ok is false where none
// does (then the lock of st is still held).
func served(a args, p params, st *shimaddr.Start) (out []byte, held *shimaddr.Lock, ok bool, err error) {
	address := shimaddr.Address(shimaddr.SocketDir(p.socketDir), p.grpcAddress, a.namespace, st.Grouping, false)
	if !shimspawn.CanConnect(address) {
		return nil, st.Lock, false, nil
	}
	defer st.Release()
	if err := st.WriteGroup(); err != nil {
		return nil, nil, false, nil
	}
	if p.socketDir != "" {
		if err := writeSocketDir(p.socketDir); err != nil {
			return nil, nil, false, nil
		}
	}
	return encodeResult(address), nil, true, nil
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
