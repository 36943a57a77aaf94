package madvguard

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/pstree"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/seccomp"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/lazyfork/lazyfork/criuimg"
)

// Synthetic images (no root, no CRIU): the chain edits themselves. The
// real-CRIU tests in criu_test.go restore what Apply writes.

type chainSpec [][]filter // per thread, oldest first

func writeSynthetic(t *testing.T, threads chainSpec) string {
	t.Helper()
	dir := t.TempDir()
	var tids []uint32
	for i := range threads {
		tids = append(tids, uint32(i+1))
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(criuimg.WriteImage(criuimg.PstreePath(dir), &criuimg.Image{Head: criuimg.MagicCommon, Magic: criuimg.MagicPstree,
		Entries: []proto.Message{&pstree.PstreeEntry{Pid: proto.Uint32(1), Ppid: proto.Uint32(0), Pgid: proto.Uint32(1), Sid: proto.Uint32(1), Threads: tids}}}))
	var filters []*seccomp.SeccompFilter
	for i, ch := range threads {
		tc := &criucore.ThreadCoreEntry{FutexRla: proto.Uint64(0), FutexRlaLen: proto.Uint32(0)}
		for j, f := range ch {
			nf := &seccomp.SeccompFilter{Filter: f.data, Flags: proto.Uint32(f.flags)}
			if j > 0 {
				nf.Prev = proto.Uint32(uint32(len(filters) - 1))
			}
			filters = append(filters, nf)
		}
		if len(ch) > 0 {
			tc.SeccompMode = criucore.SeccompMode_filter.Enum()
			tc.SeccompFilter = proto.Uint32(uint32(len(filters) - 1))
		}
		core := &criucore.CoreEntry{Mtype: criucore.CoreEntry_X86_64.Enum(), ThreadCore: tc}
		if i == 0 {
			core.Tc = &criucore.TaskCoreEntry{TaskState: proto.Uint32(taskAlive), ExitCode: proto.Uint32(0),
				Personality: proto.Uint32(0), Flags: proto.Uint32(0), BlkSigset: proto.Uint64(0), Comm: proto.String("synthetic")}
		}
		must(criuimg.WriteImage(criuimg.CorePath(dir, tids[i]), &criuimg.Image{Head: criuimg.MagicCommon, Magic: criuimg.MagicCore, Entries: []proto.Message{core}}))
	}
	must(criuimg.WriteImage(filepath.Join(dir, "seccomp.img"), &criuimg.Image{Head: criuimg.MagicCommon, Magic: criuimg.MagicSeccomp,
		Entries: []proto.Message{&seccomp.SeccompEntry{SeccompFilters: filters}}}))
	return dir
}

func chainsOf(t *testing.T, dir string) [][]filter {
	t.Helper()
	st, err := load(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out [][]filter
	for _, p := range st.procs {
		for _, c := range p.cores {
			ch, err := st.chain(c)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, ch)
		}
	}
	return out
}

func guardOf(t *testing.T, rs []Range) []byte {
	t.Helper()
	prog, err := Program(rs, Refuse)
	if err != nil {
		t.Fatal(err)
	}
	return encode(prog)
}

var (
	own1 = filter{data: []byte{6, 0, 0, 0, 0, 0, 0xff, 0x7f}} // ret ALLOW
	own2 = filter{data: []byte{6, 0, 0, 0, 1, 0, 5, 0}}       // ret ERRNO(1)
	rsA  = []Range{{0x10000, 0x20000}}
	rsB  = []Range{{0x40000000, 0x50000000}}
)

func TestApplyPerThreadChains(t *testing.T) {
	dir := writeSynthetic(t, chainSpec{{own1}, {own1, own2}})
	if err := Apply(dir, map[int][]Range{1: rsA}); err != nil {
		t.Fatal(err)
	}
	g := filter{data: guardOf(t, rsA)}
	want := [][]filter{{own1, g}, {own1, own2, g}}
	if got := chainsOf(t, dir); !reflect.DeepEqual(got, want) {
		t.Fatalf("chains after Apply:\n got %v\nwant %v", got, want)
	}
	before, _ := os.ReadFile(filepath.Join(dir, "seccomp.img"))
	if err := Apply(dir, map[int][]Range{1: rsA}); err != nil {
		t.Fatal(err)
	}
	if after, _ := os.ReadFile(filepath.Join(dir, "seccomp.img")); string(after) != string(before) {
		t.Fatal("a second Apply with the same ranges rewrote seccomp.img")
	}
}

// A thread in seccomp strict mode keeps it (zdtm's seccomp_strict): the
// guard goes to the other threads, one by one (TSYNC would fail on it).
func TestApplySkipsStrictThreads(t *testing.T) {
	dir := writeSynthetic(t, chainSpec{{}, {}})
	path := criuimg.CorePath(dir, 2)
	img, err := criuimg.ReadImage(path, criuimg.MagicCore, criuimg.Of(&criucore.CoreEntry{}))
	if err != nil {
		t.Fatal(err)
	}
	img.Entries[0].(*criucore.CoreEntry).ThreadCore.SeccompMode = criucore.SeccompMode_strict.Enum()
	if err := criuimg.WriteImage(path, img); err != nil {
		t.Fatal(err)
	}
	if err := Apply(dir, map[int][]Range{1: rsA}); err != nil {
		t.Fatal(err)
	}
	st, err := load(dir)
	if err != nil {
		t.Fatal(err)
	}
	cores := st.procs[0].cores
	if m := cores[1].GetThreadCore().GetSeccompMode(); m != criucore.SeccompMode_strict {
		t.Errorf("strict thread now in mode %v", m)
	}
	ch, err := st.chain(cores[0])
	if err != nil {
		t.Fatal(err)
	}
	if want := []filter{{data: guardOf(t, rsA)}}; !reflect.DeepEqual(ch, want) {
		t.Errorf("leader chain %v, want the guard alone without TSYNC %v", ch, want)
	}
}

func TestApplyReplacesGuardAnywhereInChain(t *testing.T) {
	// A restore installs the newest filter first, so after a dump of a copy
	// our guard can sit below the container's own filters.
	old := filter{data: guardOf(t, rsA), flags: unix.SECCOMP_FILTER_FLAG_TSYNC}
	o1 := filter{data: own1.data, flags: unix.SECCOMP_FILTER_FLAG_TSYNC}
	dir := writeSynthetic(t, chainSpec{{old, o1}, nil})
	if err := Apply(dir, map[int][]Range{1: rsB}); err != nil {
		t.Fatal(err)
	}
	g := filter{data: guardOf(t, rsB), flags: unix.SECCOMP_FILTER_FLAG_TSYNC}
	want := [][]filter{{o1, g}, nil}
	if got := chainsOf(t, dir); !reflect.DeepEqual(got, want) {
		t.Fatalf("chains:\n got %v\nwant %v", got, want)
	}
	ts, err := Inspect(dir)
	if err != nil || ts[0].Guards != 1 || !reflect.DeepEqual(ts[0].Ranges, rsB) || !ts[0].TSync {
		t.Fatalf("Inspect = %+v, %v", ts, err)
	}
	// No ranges: the guard goes, the container's filter stays.
	if err := Apply(dir, nil); err != nil {
		t.Fatal(err)
	}
	if got := chainsOf(t, dir); !reflect.DeepEqual(got, [][]filter{{o1}, nil}) {
		t.Fatalf("chains after removal: %v", got)
	}
}

func TestApplyNoFiltersUsesTSync(t *testing.T) {
	dir := writeSynthetic(t, chainSpec{nil, nil, nil})
	os.Remove(filepath.Join(dir, "seccomp.img")) // an image without one
	if err := Apply(dir, map[int][]Range{1: rsA}); err != nil {
		t.Fatal(err)
	}
	g := filter{data: guardOf(t, rsA), flags: unix.SECCOMP_FILTER_FLAG_TSYNC}
	if got := chainsOf(t, dir); !reflect.DeepEqual(got, [][]filter{{g}, nil, nil}) {
		t.Fatalf("chains: %v", got)
	}
}

func TestApplyBadInput(t *testing.T) {
	dir := writeSynthetic(t, chainSpec{{own1}})
	snap := func() map[string]string {
		m := map[string]string{}
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			b, _ := os.ReadFile(filepath.Join(dir, e.Name()))
			m[e.Name()] = string(b)
		}
		return m
	}
	before := snap()
	if err := Apply(dir, map[int][]Range{7: rsA}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("unknown pid: %v, want ErrNotFound", err)
	}
	if err := Apply(dir, map[int][]Range{1: {{0x2000, 0x1000}}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("reversed range: %v, want ErrInvalidArgument", err)
	}
	if err := ApplyMode(dir, map[int][]Range{1: rsA}, Mode(9)); err == nil {
		t.Error("bad mode accepted")
	}
	if !reflect.DeepEqual(snap(), before) {
		t.Error("a refused Apply changed the image")
	}
}
