package madvguard

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"
)

// ServeEnv names the environment variable that makes MaybeServe run a
// supervisor for the PID it holds.
const ServeEnv = "LAZYFORK_MADVGUARD_SUPERVISE"

// MaybeServe turns the process into a supervisor helper when ServeEnv is
// set (SpawnSupervisor re-executes the calling program that way), and
// exits; otherwise it returns at once. Call it first thing in main (or
// TestMain) of any program that calls SpawnSupervisor.
func MaybeServe() {
	v := os.Getenv(ServeEnv)
	if v == "" {
		return
	}
	pid, err := strconv.Atoi(v)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s=%q: not a pid\n", ServeEnv, v)
		os.Exit(2)
	}
	if err := Serve(pid, os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// Serve supervises pid's tree and answers commands, one a line, on in/out:
// "detach", "attach", "hold", "release", "unhold", "stats", "close". Each gets "ok[ details]" or
// "err message". It returns when in ends or after "close".
func Serve(pid int, in io.Reader, out io.Writer) error {
	s, err := Supervise(pid)
	if err != nil {
		fmt.Fprintf(out, "err %v\n", err)
		return err
	}
	fmt.Fprintln(out, "ok")
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		var err error
		extra := ""
		switch cmd := strings.TrimSpace(sc.Text()); cmd {
		case "detach":
			err = s.Detach()
		case "attach":
			err = s.Attach()
		case "hold":
			err = s.Hold()
		case "release":
			err = s.Release()
		case "unhold":
			err = s.Unhold()
		case "stats":
			st := s.Stats()
			extra = fmt.Sprintf(" zeroed=%d refused=%d stops=%d moved=%d busy_ns=%d", st.Zeroed, st.Refused, st.Stops, st.Moved, st.Busy.Nanoseconds())
		case "close":
			err = s.Close()
			if err != nil {
				fmt.Fprintf(out, "err %v\n", err)
				return err
			}
			fmt.Fprintln(out, "ok")
			return nil
		default:
			err = fmt.Errorf("unknown command %q", cmd)
		}
		if err != nil {
			fmt.Fprintf(out, "err %v\n", err)
		} else {
			fmt.Fprintf(out, "ok%s\n", extra)
		}
	}
	return s.Close()
}

// Remote is a supervisor running in a helper process.
type Remote struct {
	mu  sync.Mutex
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Reader
}

// SpawnSupervisor re-executes the running program as a supervisor of pid's
// tree (see MaybeServe) and waits until it is attached.
func SpawnSupervisor(pid int) (*Remote, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d", ServeEnv, pid))
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	outp, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	r := &Remote{cmd: cmd, in: in, out: bufio.NewReader(outp)}
	if _, err := r.reply(); err != nil {
		in.Close()
		cmd.Wait()
		return nil, fmt.Errorf("madvguard supervisor of %d: %w", pid, err)
	}
	return r, nil
}

func (r *Remote) reply() (string, error) {
	line, err := r.out.ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("supervisor gone: %w", err)
	}
	line = strings.TrimSpace(line)
	if rest, ok := strings.CutPrefix(line, "ok"); ok {
		return strings.TrimSpace(rest), nil
	}
	return "", fmt.Errorf("%s", strings.TrimPrefix(line, "err "))
}

func (r *Remote) call(cmd string) (string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, err := fmt.Fprintln(r.in, cmd); err != nil {
		return "", err
	}
	return r.reply()
}

// Detach lets go of the tree (before a dump).
func (r *Remote) Detach() error { _, err := r.call("detach"); return err }

// Attach traces the tree again (after a dump).
func (r *Remote) Attach() error { _, err := r.call("attach"); return err }

// Hold stops the tree's threads and keeps them stopped (see Supervisor.Hold).
func (r *Remote) Hold() error { _, err := r.call("hold"); return err }

// Release detaches from the held threads (see Supervisor.Release).
func (r *Remote) Release() error { _, err := r.call("release"); return err }

// Unhold lets the held threads run on, traced.
func (r *Remote) Unhold() error { _, err := r.call("unhold"); return err }

// Stats returns the supervisor's counts.
func (r *Remote) Stats() (Stats, error) {
	s, err := r.call("stats")
	if err != nil {
		return Stats{}, err
	}
	var st Stats
	for _, kv := range strings.Fields(s) {
		k, v, _ := strings.Cut(kv, "=")
		n, _ := strconv.ParseUint(v, 10, 64)
		switch k {
		case "zeroed":
			st.Zeroed = n
		case "refused":
			st.Refused = n
		case "stops":
			st.Stops = n
		case "moved":
			st.Moved = n
		case "busy_ns":
			st.Busy = time.Duration(n)
		}
	}
	return st, nil
}

// Close detaches, stops the helper and waits for it.
func (r *Remote) Close() error {
	_, err := r.call("close")
	r.in.Close()
	werr := r.cmd.Wait()
	if err == nil {
		err = werr
	}
	return err
}
