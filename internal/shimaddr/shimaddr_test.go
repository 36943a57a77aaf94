package shimaddr

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/defaults"
	"github.com/containerd/containerd/v2/pkg/identifiers"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/shim"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/api"
)

func TestNamesMatchTheirOwners(t *testing.T) {
	if AnnotationShimGroup != api.AnnotationShimGroup {
		t.Errorf("AnnotationShimGroup %q, api says %q", AnnotationShimGroup, api.AnnotationShimGroup)
	}
	if want := filepath.Join(defaults.DefaultStateDir, "s"); DefaultSocketDir != want {
		t.Errorf("DefaultSocketDir %q, containerd's %q", DefaultSocketDir, want)
	}
}

// The front and the shim find a group's shim where containerd's pkg/shim
// (which runc's manager calls) puts it, for every namespace, containerd
// address, group and socket directory, and the debug socket too.
func TestAddressIsContainerdsSocketAddress(t *testing.T) {
	for _, ns := range []string{"default", "k8s.io", "lazyfork-test-1"} {
		ctx := namespaces.WithNamespace(context.Background(), ns)
		for _, grpc := range []string{"/run/containerd/containerd.sock", "/tmp/lfh-123/containerd.sock", "", "/a//b/../c.sock"} {
			for _, grouping := range []string{"c1", GroupID("fam-snap-0"), GroupID(strings.Repeat("x", 90))} {
				for _, debug := range []bool{false, true} {
					want, err := shim.SocketAddress(ctx, grpc, grouping, debug)
					if err != nil {
						t.Fatal(err)
					}
					if got := Address(SocketDir(""), grpc, ns, grouping, debug); got != want {
						t.Errorf("Address(default, %q, %q, %q, %v) = %q, containerd's %q", grpc, ns, grouping, debug, got, want)
					}
					dir := "/tmp/lfh-123/s"
					want, err = shim.CreateSocketAddress(ctx, dir, grpc, grouping, debug)
					if err != nil {
						t.Fatal(err)
					}
					if got := Address(SocketDir(dir), grpc, ns, grouping, debug); got != want {
						t.Errorf("Address(%q, %q, %q, %q, %v) = %q, containerd's %q", dir, grpc, ns, grouping, debug, got, want)
					}
				}
			}
		}
	}
}

// ValidIdentifier accepts exactly what containerd's identifiers.Validate
// accepts.
func TestValidIdentifierIsContainerds(t *testing.T) {
	cases := []string{"", "a", "a.b", "a..b", ".a", "a.", "a-b_c.d", "A9", "a b", "é", "a/b",
		strings.Repeat("a", 76), strings.Repeat("a", 77), "lazyfork-group-fam-x-0"}
	r := rand.New(rand.NewPCG(1, 2))
	const alphabet = "aZ9._-/ "
	for range 20000 {
		b := make([]byte, r.IntN(8))
		for i := range b {
			b[i] = alphabet[r.IntN(len(alphabet))]
		}
		cases = append(cases, string(b))
	}
	for _, s := range cases {
		if got, want := ValidIdentifier(s), identifiers.Validate(s) == nil; got != want {
			t.Errorf("ValidIdentifier(%q) = %v, containerd says %v", s, got, want)
		}
	}
}

// A group name too long or odd for containerd's identifiers still groups,
// by its digest, and distinct names stay distinct.
func TestGroupID(t *testing.T) {
	long := strings.Repeat("f", 64) + "-" + strings.Repeat("a", 32) + "-0"
	a, b := GroupID(long), GroupID(long[:len(long)-1]+"1")
	if a == b || identifiers.Validate(a) != nil || identifiers.Validate(b) != nil {
		t.Fatalf("groups %q and %q: want distinct valid identifiers", a, b)
	}
	if g := GroupID("fam-x-0"); g != GroupPrefix+"fam-x-0" {
		t.Errorf("short group %q, want it kept readable", g)
	}
}

// A batch of forks names its shim group; PrepareStart and WriteGroup turn
// that into runc's group. A family annotation alone never groups (a container naming another's
// family must not land in its shim), CRI pods and explicit groups are left
// alone, and a spec already rewritten keeps its group (and its lock).
func TestPrepareStart(t *testing.T) {
	for _, tc := range []struct {
		ann       map[string]string
		want      string // runc's group in the spec afterwards
		lock      string // the group PrepareStart locks
		grouping  string // Grouping of container "c1" afterwards
		untouched bool
	}{
		{map[string]string{api.AnnotationFamily: "fam"}, "", "", "c1", true},
		{map[string]string{api.AnnotationFamily: "fam", AnnotationShimGroup: "fam-x-0"}, GroupPrefix + "fam-x-0", GroupPrefix + "fam-x-0", GroupPrefix + "fam-x-0", false},
		{map[string]string{AnnotationShimGroup: "fam-x-0", AnnotationRuncGroup: GroupPrefix + "fam-x-0"}, GroupPrefix + "fam-x-0", GroupPrefix + "fam-x-0", GroupPrefix + "fam-x-0", true},
		{map[string]string{AnnotationShimGroup: "b", AnnotationRuncGroup: "g"}, "g", "", "g", true},
		{map[string]string{AnnotationShimGroup: "b", AnnotationCRISandbox: "pod"}, "", "", "pod", true},
		{nil, "", "", "c1", true},
	} {
		dir := t.TempDir()
		doc := map[string]any{"ociVersion": "1.2.0", "process": map[string]any{"args": []string{"x"}}}
		if tc.ann != nil {
			doc["annotations"] = tc.ann
		}
		in, _ := json.Marshal(doc)
		path := filepath.Join(dir, SpecFile)
		if err := os.WriteFile(path, in, 0o600); err != nil {
			t.Fatal(err)
		}
		st, err := PrepareStart(dir, dir, "c1")
		if err != nil {
			t.Fatal(err)
		}
		if st.Group != tc.lock || (st.Lock != nil) != (tc.lock != "") {
			t.Errorf("annotations %v: group %q locked %v, want %q", tc.ann, st.Group, st.Lock != nil, tc.lock)
		}
		if out, _ := os.ReadFile(path); string(out) != string(in) {
			t.Errorf("annotations %v: PrepareStart wrote the spec", tc.ann)
		}
		if err := st.WriteGroup(); err != nil {
			t.Fatal(err)
		}
		st.Release()
		out, _ := os.ReadFile(path)
		if tc.untouched && string(out) != string(in) {
			t.Errorf("annotations %v: spec rewritten:\n%s\nwas\n%s", tc.ann, out, in)
		}
		var got struct {
			Annotations map[string]string `json:"annotations"`
			Process     struct{ Args []string }
		}
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatal(err)
		}
		if g := got.Annotations[AnnotationRuncGroup]; g != tc.want {
			t.Errorf("annotations %v: group %q, want %q", tc.ann, g, tc.want)
		}
		if len(got.Process.Args) != 1 || got.Process.Args[0] != "x" {
			t.Errorf("spec lost its process: %s", out)
		}
		if g := Grouping("c1", got.Annotations); g != tc.grouping || st.Grouping != g {
			t.Errorf("annotations %v: grouping %q (PrepareStart said %q), want %q", tc.ann, g, st.Grouping, tc.grouping)
		}
		if ents, _ := filepath.Glob(filepath.Join(dir, ".lazyfork-start-*")); len(ents) != 0 {
			t.Errorf("annotations %v: lock files left: %v", tc.ann, ents)
		}
	}
}

// The start lock excludes a second holder until released, and leaves no file.
func TestLockStart(t *testing.T) {
	dir := t.TempDir()
	lock, err := LockStart(dir, "g")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *Lock)
	go func() {
		l, err := LockStart(dir, "g")
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	other, err := LockStart(dir, "h")
	if err != nil {
		t.Fatal(err)
	}
	other.Release()
	select {
	case <-got:
		t.Fatal("second holder of g got the lock while the first held it")
	default:
	}
	lock.Release()
	(<-got).Release()
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("lock files left: %v", ents)
	}
}

// A lock handed over (as the front does to the full shim across exec) is
// the inheritor's, for its group only; the hand-over leaves the environment
// and the descriptor closes on the next exec again.
func TestLockHandoff(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		group string
		taken bool
	}{{"g", true}, {"other", false}} {
		lock, err := LockStart(dir, "g")
		if err != nil {
			t.Fatal(err)
		}
		kv, err := lock.Handoff()
		if err != nil {
			t.Fatal(err)
		}
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
		fds, _, _ := strings.Cut(v, ":")
		fd, err := strconv.Atoi(fds)
		if err != nil {
			t.Fatalf("%s=%s: %v", k, v, err)
		}
		lock.f.Close() // what the exec does to the front's own (close-on-exec) descriptor
		inherited := InheritedLock(dir, tc.group)
		if _, still := os.LookupEnv(LockEnv); still {
			t.Errorf("%s still in the environment", LockEnv)
		}
		if (inherited != nil) != tc.taken {
			t.Fatalf("group %s: inherited %v, want %v", tc.group, inherited != nil, tc.taken)
		}
		if inherited == nil {
			if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err == nil {
				t.Errorf("group %s: the handed-over descriptor %d is still open", tc.group, fd)
			}
			if free, err := tryLock(dir, "g"); err != nil || !free {
				t.Errorf("group %s: the lock of g refused is still held (%v)", tc.group, err)
			}
			os.Remove(lockPath(dir, "g"))
			continue
		}
		if flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil || flags&unix.FD_CLOEXEC == 0 {
			t.Errorf("inherited descriptor flags %#x %v: want close-on-exec", flags, err)
		}
		if l, err := tryLock(dir, "g"); err != nil || l {
			t.Errorf("inherited lock not held: another open could lock it (%v)", err)
		}
		inherited.Release()
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("lock files left: %v", ents)
	}
}

// tryLock reports whether group's lock file could be locked now.
func tryLock(dir, group string) (bool, error) {
	f, err := os.Open(lockPath(dir, group))
	if err != nil {
		return false, err
	}
	defer f.Close()
	err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	if err == unix.EWOULDBLOCK {
		return false, nil
	}
	return err == nil, err
}
