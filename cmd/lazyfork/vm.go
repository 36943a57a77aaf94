package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"text/tabwriter"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/errdefs"
	"github.com/spf13/pflag"

	"github.com/lazyfork/lazyfork/deploy/lima"
	lazyforkv1 "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
	snapclient "github.com/lazyfork/lazyfork/snapshotter/client"
)

// vmOpts are lazyfork vm's flags.
type vmOpts struct {
	name    string
	source  string
	format  string
	timeout time.Duration
}

func init() {
	var o vmOpts
	register(&command{
		name: "vm",
		args: "start|status|stop|delete|shell [-- CMD...]",
		short: "run LazyFork in a Linux VM (Lima) and point the other commands at it: " +
			"how a Mac uses LazyFork",
		example: `  lazyfork vm start            # create (first time: installs the stack, long) and boot the VM
  lazyfork list                # every command now drives the VM through its forwarded sockets
  lazyfork vm status           # the guest, containerd, the snapshotter and LazyFork versions
  lazyfork vm shell -- sudo lazyfork status
  lazyfork vm stop; lazyfork vm delete
The VM is Lima's (limactl must be on PATH, or $LIMACTL), made from deploy/lima/lazyfork.yaml
and the LazyFork checkout --source (default: the one the current directory is in), set up with
the same make targets as a Linux host (make deps images install, lazyfork setup).`,
		noConn: true,
		flags: func(fs *pflag.FlagSet) {
			fs.StringVar(&o.name, "name", "lazyfork", "the Lima instance")
			fs.StringVar(&o.source, "source", "", "start: the LazyFork checkout the VM installs (default: the one the current directory is in)")
			fs.DurationVar(&o.timeout, "timeout", 90*time.Minute, "start: how long to wait for the VM and its set-up")
			addFormat(fs, &o.format)
		},
		run: func(a *app, fs *pflag.FlagSet, pos, cmd []string) error {
			if len(pos) == 0 {
				return fmt.Errorf("want lazyfork vm start|status|stop|delete|shell: %w", errdefs.ErrInvalidArgument)
			}
			if len(pos) > 1 {
				return fmt.Errorf("lazyfork vm %s: unexpected %q (a command for vm shell goes after --): %w", pos[0], pos[1:], errdefs.ErrInvalidArgument)
			}
			l, err := findLima(a.out, os.Stderr)
			if err != nil {
				return err
			}
			switch pos[0] {
			case "start":
				return l.start(a.ctx, o)
			case "status":
				return l.status(a.ctx, o, a.out)
			case "stop":
				return l.stop(o)
			case "delete":
				return l.delete(o)
			case "shell":
				return l.shell(o, cmd)
			}
			return fmt.Errorf("lazyfork vm %s: want start, status, stop, delete or shell: %w", pos[0], errdefs.ErrInvalidArgument)
		},
	})
}

// limactl drives Lima's CLI.
type limactl struct {
	bin      string
	out, err io.Writer
}

func findLima(out, errOut io.Writer) (*limactl, error) {
	bin := os.Getenv("LIMACTL")
	if bin == "" {
		var err error
		if bin, err = exec.LookPath("limactl"); err != nil {
			hint := "install Lima (https://lima-vm.io"
			if runtime.GOOS == "darwin" {
				hint += "; brew install lima"
			}
			return nil, fmt.Errorf("limactl not found on PATH: %s), or set $LIMACTL: %w", hint+")", errdefs.ErrNotFound)
		}
	}
	return &limactl{bin: bin, out: out, err: errOut}, nil
}

// limaInstance is one line of limactl list --json.
type limaInstance struct {
	Name   string `json:"name"`
	Status string `json:"status"`
	Dir    string `json:"dir"`
	Arch   string `json:"arch"`
	CPUs   int    `json:"cpus"`
	Memory int64  `json:"memory"`
	Disk   int64  `json:"disk"`
	VMType string `json:"vmType"`
}

// run runs limactl with args, its output on l's writers.
func (l *limactl) run(args ...string) error {
	c := exec.Command(l.bin, args...)
	c.Stdout, c.Stderr = l.out, l.err
	if err := c.Run(); err != nil {
		return fmt.Errorf("%s %s: %w", filepath.Base(l.bin), strings.Join(args, " "), err)
	}
	return nil
}

// instance is Lima's instance name, nil if there is none.
func (l *limactl) instance(name string) (*limaInstance, error) {
	c := exec.Command(l.bin, "list", "--json")
	var stderr bytes.Buffer
	c.Stderr = &stderr
	out, err := c.Output()
	if err != nil {
		return nil, fmt.Errorf("limactl list --json: %v: %s", err, strings.TrimSpace(stderr.String()))
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		var in limaInstance
		if err := json.Unmarshal(line, &in); err != nil {
			return nil, fmt.Errorf("limactl list --json printed %q: %v", line, err)
		}
		if in.Name == name {
			return &in, nil
		}
	}
	return nil, nil
}

// sockets are the instance's forwarded sockets on this host.
func (in *limaInstance) sockets() (address, api string) {
	return filepath.Join(in.Dir, lima.ContainerdSocket), filepath.Join(in.Dir, lima.APISocket)
}

func (l *limactl) progress(format string, args ...any) {
	fmt.Fprintf(l.err, "vm: "+format+"\n", args...)
}

// start creates the VM if it is missing, boots it if it is stopped, waits
// until containerd and the node API answer through the forwarded sockets
// and records them for the other commands. A running VM is left as it is.
func (l *limactl) start(ctx context.Context, o vmOpts) error {
	in, err := l.instance(o.name)
	if err != nil {
		return err
	}
	if in == nil {
		src, err := checkoutDir(o.source)
		if err != nil {
			return err
		}
		tmpl, err := os.CreateTemp("", "lazyfork-lima-*.yaml")
		if err != nil {
			return err
		}
		defer os.Remove(tmpl.Name())
		if _, err := tmpl.Write(lima.Template); err != nil {
			tmpl.Close()
			return err
		}
		tmpl.Close()
		l.progress("creating VM %s (Lima template deploy/lima/lazyfork.yaml, LazyFork from %s)", o.name, src)
		if err := l.run("--tty=false", "create", "--name="+o.name, "--set", fmt.Sprintf(".param.SOURCE = %q", src), tmpl.Name()); err != nil {
			return err
		}
		if in, err = l.instance(o.name); err != nil {
			return err
		}
		if in == nil {
			return fmt.Errorf("limactl create made no instance %s: %w", o.name, errdefs.ErrUnknown)
		}
	}
	if in.Status != "Running" {
		l.progress("starting VM %s (%s); the first start installs LazyFork's stack in it (make deps images install, lazyfork setup): tens of minutes", o.name, in.Status)
		if err := l.run("--tty=false", "start", "--timeout="+o.timeout.String(), o.name); err != nil {
			return fmt.Errorf("%w\n(the guest's set-up log: lazyfork vm shell -- sudo tail -n 100 /var/log/cloud-init-output.log)", err)
		}
		if in, err = l.instance(o.name); err != nil {
			return err
		}
	} else {
		l.progress("VM %s is running", o.name)
	}
	address, api := in.sockets()
	l.progress("waiting for containerd (%s) and LazyFork's node API (%s)", address, api)
	if err := vmReady(ctx, address, api, o.timeout); err != nil {
		return err
	}
	p, err := writeVMContext(&vmContext{Instance: o.name, Dir: in.Dir, Address: address, API: api})
	if err != nil {
		return err
	}
	l.progress("ready: lazyfork commands use VM %s while it runs (%s)", o.name, p)
	return nil
}

// vmReady waits for the VM's sockets (waitVM; tests replace it).
var vmReady = waitVM

// waitVM waits until containerd and the snapshotter answer at the sockets.
func waitVM(ctx context.Context, address, api string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var err error
	for {
		if _, err = vmVersions(ctx, address, api); err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the VM's sockets do not answer after %v: %w", timeout, err)
		}
		time.Sleep(2 * time.Second)
	}
}

// vmVersions asks containerd and the snapshotter for their versions.
func vmVersions(ctx context.Context, address, api string) ([2]string, error) {
	var v [2]string
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if !answers(address) {
		return v, fmt.Errorf("containerd's socket %s does not answer: %w", address, errdefs.ErrUnavailable)
	}
	cd, err := containerd.New(address, containerd.WithTimeout(5*time.Second))
	if err != nil {
		return v, fmt.Errorf("containerd at %s: %w", address, err)
	}
	defer cd.Close()
	cv, err := cd.Version(cctx)
	if err != nil {
		return v, fmt.Errorf("containerd at %s: %w", address, err)
	}
	v[0] = cv.Version
	sn, err := snapclient.Dial(cctx, api)
	if err != nil {
		return v, err
	}
	defer sn.Close()
	st, err := sn.Status(cctx, &lazyforkv1.StatusRequest{})
	if err != nil {
		return v, fmt.Errorf("lazyfork-snapshotter at %s: %w", api, err)
	}
	v[1] = st.Version
	return v, nil
}

// vmStatus is lazyfork vm status.
type vmStatus struct {
	Instance    string `json:"instance"`
	Status      string `json:"status"` // Lima's: Running, Stopped, Broken; "absent"
	Arch        string `json:"arch,omitempty"`
	CPUs        int    `json:"cpus,omitempty"`
	Memory      int64  `json:"memoryBytes,omitempty"`
	Dir         string `json:"dir,omitempty"`
	Address     string `json:"address,omitempty"`
	API         string `json:"api,omitempty"`
	Guest       string `json:"guest,omitempty"`
	Containerd  string `json:"containerd,omitempty"`
	Snapshotter string `json:"snapshotter,omitempty"`
	// LazyFork is the guest's lazyfork; CLI is this one.
	LazyFork string `json:"lazyfork,omitempty"`
	CLI      string `json:"cli"`
	// Default: the other commands use this VM.
	Default bool `json:"default"`
}

func (l *limactl) status(ctx context.Context, o vmOpts, out io.Writer) error {
	of, err := parseFormat(o.format)
	if err != nil {
		return err
	}
	s := vmStatus{Instance: o.name, Status: "absent", CLI: versionString()}
	in, err := l.instance(o.name)
	if err != nil {
		return err
	}
	if in != nil {
		s.Status, s.Arch, s.CPUs, s.Memory, s.Dir = in.Status, in.Arch, in.CPUs, in.Memory, in.Dir
		s.Address, s.API = in.sockets()
	}
	if in != nil && in.Status == "Running" {
		s.Guest = l.guestOutput(o.name, "sh", "-c", `. /etc/os-release; echo "$PRETTY_NAME, kernel $(uname -r)"`)
		s.LazyFork = strings.TrimPrefix(firstLineOf(l.guestOutput(o.name, "/usr/local/bin/lazyfork", "version")), "lazyfork version ")
		if v, err := vmVersions(ctx, s.Address, s.API); err == nil {
			s.Containerd, s.Snapshotter = v[0], v[1]
		} else {
			if v[0] != "" {
				s.Containerd = v[0]
			} else {
				s.Containerd = "unreachable: " + err.Error()
			}
			s.Snapshotter = "unreachable: " + err.Error()
		}
		if c, err := readVMContext(); err == nil && c.Instance == o.name && c.Address == s.Address {
			s.Default = os.Getenv("CONTAINERD_ADDRESS") == "" && os.Getenv("LAZYFORK_API") == ""
		}
	}
	switch of.kind {
	case "json":
		e := json.NewEncoder(out)
		e.SetIndent("", "  ")
		return e.Encode(s)
	case "template":
		return of.template(out, s)
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "vm:\t%s\nstatus:\t%s\n", s.Instance, s.Status)
	if in == nil {
		fmt.Fprintf(tw, "\t(lazyfork vm start creates it)\n")
	} else {
		fmt.Fprintf(tw, "arch:\t%s\ncpus:\t%d\nmemory:\t%s\ndir:\t%s\n", s.Arch, s.CPUs, human(s.Memory), s.Dir)
	}
	if s.Status == "Running" {
		fmt.Fprintf(tw, "guest:\t%s\ncontainerd:\t%s\t(%s)\nsnapshotter:\t%s\t(node API %s)\nlazyfork (guest):\t%s\n",
			orDash(s.Guest), s.Containerd, s.Address, s.Snapshotter, s.API, orDash(s.LazyFork))
		def := "no (--address/--api or the environment choose another)"
		if s.Default {
			def = "yes"
		}
		fmt.Fprintf(tw, "default for lazyfork commands:\t%s\n", def)
	}
	fmt.Fprintf(tw, "lazyfork (here):\t%s\n", s.CLI)
	return tw.Flush()
}

// guestOutput runs argv in the guest, its output or what failed.
func (l *limactl) guestOutput(name string, argv ...string) string {
	c := exec.Command(l.bin, append([]string{"shell", "--workdir", "/", name}, argv...)...)
	out, err := c.CombinedOutput()
	if err != nil {
		return fmt.Sprintf("unknown (%v: %s)", err, strings.TrimSpace(string(out)))
	}
	return strings.TrimSpace(string(out))
}

func firstLineOf(s string) string {
	l, _, _ := strings.Cut(s, "\n")
	return strings.TrimSpace(l)
}

func (l *limactl) stop(o vmOpts) error {
	in, err := l.instance(o.name)
	if err != nil {
		return err
	}
	if in == nil {
		return fmt.Errorf("no VM %s (lazyfork vm start creates it): %w", o.name, errdefs.ErrNotFound)
	}
	if in.Status == "Stopped" {
		l.progress("VM %s is stopped", o.name)
		return nil
	}
	l.progress("stopping VM %s; its containers end (lazyfork vm start boots it again)", o.name)
	return l.run("stop", o.name)
}

// delete removes the VM with everything in it, and the commands' pointer
// to it.
func (l *limactl) delete(o vmOpts) error {
	in, err := l.instance(o.name)
	if err != nil {
		return err
	}
	if in != nil {
		l.progress("deleting VM %s and everything in it", o.name)
		if err := l.run("delete", "--force", o.name); err != nil {
			return err
		}
	} else {
		l.progress("no VM %s", o.name)
	}
	if c, err := readVMContext(); err == nil && c.Instance == o.name {
		return removeVMContext()
	}
	return nil
}

// shell runs a shell (or cmd) in the VM, passing its exit status on.
func (l *limactl) shell(o vmOpts, cmd []string) error {
	c := exec.Command(l.bin, append([]string{"shell", o.name}, cmd...)...)
	c.Stdin, c.Stdout, c.Stderr = os.Stdin, os.Stdout, os.Stderr
	err := c.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() > 0 {
		return exitCode(ee.ExitCode())
	}
	return err
}

// checkoutDir is the LazyFork checkout the VM installs: dir, else the one
// the working directory is in (a go.mod of module github.com/lazyfork/lazyfork).
func checkoutDir(dir string) (string, error) {
	start := dir
	if start == "" {
		var err error
		if start, err = os.Getwd(); err != nil {
			return "", err
		}
	}
	start, err := filepath.Abs(start)
	if err != nil {
		return "", err
	}
	for d := start; ; d = filepath.Dir(d) {
		if b, err := os.ReadFile(filepath.Join(d, "go.mod")); err == nil && bytes.HasPrefix(bytes.TrimSpace(b), []byte("module github.com/lazyfork/lazyfork\n")) {
			return d, nil
		}
		if dir != "" || d == filepath.Dir(d) {
			break
		}
	}
	return "", fmt.Errorf("%s is not in a LazyFork checkout (the VM installs LazyFork from one: run from it, or pass --source DIR): %w", start, errdefs.ErrInvalidArgument)
}
