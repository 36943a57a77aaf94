package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/lazyfork/lazyfork/deploy/lima"
)

// fakeLimactl is a limactl that keeps one instance's state in dir and logs
// every call (one line each) to dir/log.
const fakeLimactl = `#!/bin/sh
s=$FAKE_LIMA
echo "$*" >>"$s/log"
case "$1" in --tty=false) shift;; esac
case "$1" in
list)
	[ -f "$s/created" ] && printf '{"name":"%s","status":"%s","dir":"%s","arch":"x86_64","cpus":4,"memory":8589934592}\n' "$(cat "$s/created")" "$(cat "$s/status")" "$s/inst"
	printf '{"name":"other","status":"Running","dir":"/nowhere"}\n';;
create)
	name=${2#--name=}; echo "$name" >"$s/created"; echo Stopped >"$s/status"; mkdir -p "$s/inst/sock"
	eval "last=\${$#}"; cp "$last" "$s/template.yaml";;
start) echo Running >"$s/status";;
stop) echo Stopped >"$s/status";;
delete) rm -f "$s/created" "$s/status";;
shell)
	case "$*" in
	*os-release*) echo "Debian GNU/Linux 12 (bookworm), kernel 6.1.0";;
	*version*) echo "lazyfork version v9.9.9"; echo "  go: go1.26";;
	*) shift; shift; echo "ran: $*"; exit 3;;
	esac;;
esac
`

// vmTest runs lazyfork vm against fakeLimactl, with the VM's sockets
// reported ready, and returns the run func and the state dir.
func vmTest(t *testing.T) (func(args ...string) (string, error), string) {
	t.Helper()
	dir := t.TempDir()
	bin := filepath.Join(dir, "limactl")
	if err := os.WriteFile(bin, []byte(fakeLimactl), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("LIMACTL", bin)
	t.Setenv("FAKE_LIMA", dir)
	t.Setenv("LAZYFORK_VM_CONTEXT", filepath.Join(dir, "home", "vm.json"))
	t.Setenv("CONTAINERD_ADDRESS", "")
	t.Setenv("LAZYFORK_API", "")
	var waited []string
	old := vmReady
	vmReady = func(_ context.Context, address, api string, _ time.Duration) error {
		waited = append(waited, address, api)
		return nil
	}
	t.Cleanup(func() { vmReady = old })
	return func(args ...string) (string, error) {
		var out, errOut bytes.Buffer
		err := execute(append([]string{"vm"}, args...), &out, &errOut)
		return out.String(), err
	}, dir
}

func calls(t *testing.T, dir string) []string {
	b, _ := os.ReadFile(filepath.Join(dir, "log"))
	var out []string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if l != "" && !strings.HasPrefix(l, "list") {
			out = append(out, l)
		}
	}
	return out
}

// TestVMStartIdempotent: the first vm start creates the instance from the
// repository's template with this checkout as its source and boots it; the
// second finds it running and changes nothing; both record the forwarded
// sockets for the other commands.
func TestVMStartIdempotent(t *testing.T) {
	vm, dir := vmTest(t)
	src, err := checkoutDir("")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vm("start"); err != nil {
		t.Fatal(err)
	}
	c := calls(t, dir)
	if len(c) != 2 || !strings.HasPrefix(c[0], "--tty=false create --name=lazyfork --set .param.SOURCE = \""+src+"\" ") ||
		!strings.HasPrefix(c[1], "--tty=false start --timeout=") || !strings.HasSuffix(c[1], " lazyfork") {
		t.Fatalf("limactl calls: %q", c)
	}
	tmpl, _ := os.ReadFile(filepath.Join(dir, "template.yaml"))
	if !bytes.Equal(tmpl, lima.Template) {
		t.Error("vm start did not create the VM from deploy/lima/lazyfork.yaml")
	}
	ctx, err := readVMContext()
	if err != nil {
		t.Fatal(err)
	}
	want := vmContext{Instance: "lazyfork", Dir: filepath.Join(dir, "inst"),
		Address: filepath.Join(dir, "inst", lima.ContainerdSocket), API: filepath.Join(dir, "inst", lima.APISocket)}
	if *ctx != want {
		t.Errorf("context %+v, want %+v", *ctx, want)
	}
	if _, err := vm("start"); err != nil {
		t.Fatal(err)
	}
	if c2 := calls(t, dir); len(c2) != 2 {
		t.Errorf("a second vm start called limactl: %q", c2[2:])
	}
	// A stopped VM is started, not created again.
	if _, err := vm("stop"); err != nil {
		t.Fatal(err)
	}
	if _, err := vm("start"); err != nil {
		t.Fatal(err)
	}
	if c3 := calls(t, dir); len(c3) != 4 || c3[2] != "stop lazyfork" || !strings.HasPrefix(c3[3], "--tty=false start ") {
		t.Errorf("stop, start: %q", c3)
	}
}

// TestVMStatusAndDelete: status names the guest and LazyFork in it (from
// the guest) and containerd and the snapshotter (through the sockets);
// delete removes the VM and the other commands' pointer to it.
func TestVMStatusAndDelete(t *testing.T) {
	vm, dir := vmTest(t)
	out, err := vm("status", "--format", "json")
	if err != nil {
		t.Fatal(err)
	}
	var s vmStatus
	if err := json.Unmarshal([]byte(out), &s); err != nil || s.Status != "absent" {
		t.Fatalf("status of no VM: %s (%v)", out, err)
	}
	if _, err := vm("start"); err != nil {
		t.Fatal(err)
	}
	out, err = vm("status", "--format", "json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		t.Fatal(err)
	}
	if s.Status != "Running" || s.Guest != "Debian GNU/Linux 12 (bookworm), kernel 6.1.0" || s.LazyFork != "v9.9.9" ||
		!strings.HasPrefix(s.Containerd, "unreachable") || s.CPUs != 4 {
		// containerd is unreachable: the fake VM forwards no sockets.
		t.Errorf("status: %+v", s)
	}
	if out, err := vm("status"); err != nil || !strings.Contains(out, "guest:") || !strings.Contains(out, "snapshotter:") {
		t.Errorf("status table: %v\n%s", err, out)
	}
	if err := execute([]string{"vm", "shell", "--", "uname", "-a"}, new(bytes.Buffer), new(bytes.Buffer)); err == nil || err.Error() != "exit status 3" {
		t.Errorf("vm shell's exit status: %v", err)
	}
	if _, err := vm("delete"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "created")); err == nil {
		t.Error("vm delete left the instance")
	}
	if _, err := readVMContext(); !os.IsNotExist(err) {
		t.Errorf("vm delete left the context: %v", err)
	}
	if c := calls(t, dir); c[len(c)-1] != "delete --force lazyfork" {
		t.Errorf("limactl calls: %q", c)
	}
}

// TestVMDefaults: the commands use the VM's sockets while containerd
// answers there, and not when it does not or the environment says
// otherwise.
func TestVMDefaults(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("LAZYFORK_VM_CONTEXT", filepath.Join(dir, "vm.json"))
	t.Setenv("CONTAINERD_ADDRESS", "")
	t.Setenv("LAZYFORK_API", "")
	sock, api := filepath.Join(dir, "c.sock"), filepath.Join(dir, "api.sock")
	if _, err := writeVMContext(&vmContext{Instance: "lazyfork", Address: sock, API: api}); err != nil {
		t.Fatal(err)
	}
	if g := defaultGlobals(); g.address == sock {
		t.Errorf("a VM whose socket does not answer is the default: %+v", g)
	}
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if g := defaultGlobals(); g.address != sock || g.api != api {
		t.Errorf("the running VM is not the default: %+v", g)
	}
	t.Setenv("CONTAINERD_ADDRESS", "/elsewhere.sock")
	if g := defaultGlobals(); g.address != "/elsewhere.sock" || g.api == api {
		t.Errorf("$CONTAINERD_ADDRESS does not win over the VM: %+v", g)
	}
}

// TestVMWithoutLima: without limactl, vm says what to install.
func TestVMWithoutLima(t *testing.T) {
	t.Setenv("LIMACTL", "")
	t.Setenv("PATH", t.TempDir())
	err := execute([]string{"vm", "status"}, new(bytes.Buffer), new(bytes.Buffer))
	if err == nil || !strings.Contains(err.Error(), "limactl not found") || !strings.Contains(err.Error(), "lima-vm.io") {
		t.Errorf("err = %v", err)
	}
}
