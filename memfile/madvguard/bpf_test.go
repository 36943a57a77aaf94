package madvguard

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"reflect"
	"testing"

	"golang.org/x/sys/unix"
)

// The filter is checked by the real kernel: a child process (this test
// binary re-executed) sets no_new_privs, installs the guard and reports
// what madvise returned. No root needed.

const childEnv = "MADVGUARD_TEST_CHILD"

type call struct {
	Addr, Len uint64
	Advice    int
	// An mremap(Addr, Len, NewLen, Flags, NewAddr) when NewLen > 0. The
	// child maps its playground afresh before each, and unmaps where the
	// call moved or copied the mapping to after it.
	NewLen, NewAddr uint64
	Flags           int
}

// target is where the mremap calls with MREMAP_FIXED move to.
const target = 0x7f0000000000

type childReq struct {
	Ranges []Range
	Mode   Mode
	Calls  []call
}

func TestMain(m *testing.M) {
	MaybeServe() // SpawnSupervisor re-executes the test binary
	if os.Getenv(childEnv) != "" {
		os.Exit(child())
	}
	os.Exit(m.Run())
}

// mapping reserves the address space the tests play in.
var mappings = []Range{
	{0x7e0000000000, 0x7e0000000000 + 16<<20},
	{0x2fff00000, 0x300100000}, // straddles a 4 GiB boundary: carries in the 64-bit compare
}

func child() int {
	var req childReq
	if err := json.Unmarshal([]byte(os.Getenv(childEnv)), &req); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	for _, m := range mappings {
		if _, _, e := unix.Syscall6(unix.SYS_MMAP, uintptr(m.Start), uintptr(m.End-m.Start),
			unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED_NOREPLACE, ^uintptr(0), 0); e != 0 {
			fmt.Fprintln(os.Stderr, "mmap:", e)
			return 2
		}
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if err := Install(req.Ranges, req.Mode); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	res := make([]string, len(req.Calls))
	for i, c := range req.Calls {
		var e unix.Errno
		if c.NewLen == 0 {
			_, _, e = unix.Syscall(unix.SYS_MADVISE, uintptr(c.Addr), uintptr(c.Len), uintptr(c.Advice))
		} else {
			for _, m := range mappings {
				if _, _, e := unix.Syscall6(unix.SYS_MMAP, uintptr(m.Start), uintptr(m.End-m.Start),
					unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED, ^uintptr(0), 0); e != 0 {
					fmt.Fprintln(os.Stderr, "mmap:", e)
					return 2
				}
			}
			var r uintptr
			r, _, e = unix.Syscall6(unix.SYS_MREMAP, uintptr(c.Addr), uintptr(c.Len), uintptr(c.NewLen), uintptr(c.Flags), uintptr(c.NewAddr), 0)
			if e == 0 && r != uintptr(c.Addr) {
				unix.Syscall(unix.SYS_MUNMAP, r, uintptr(c.NewLen), 0)
			}
		}
		res[i] = "ok"
		if e != 0 {
			res[i] = e.Error()
		}
	}
	json.NewEncoder(os.Stdout).Encode(res)
	return 0
}

func runChild(t *testing.T, req childReq) []string {
	t.Helper()
	b, _ := json.Marshal(req)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+string(b))
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("child: %v", err)
	}
	var res []string
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("child output %q: %v", out, err)
	}
	return res
}

func intersects(rs []Range, addr, n uint64) bool {
	if n == 0 {
		return false
	}
	for _, r := range rs {
		if addr < r.End && addr+n > r.Start {
			return true
		}
	}
	return false
}

func TestFilterInKernel(t *testing.T) {
	// Zero mode with no tracer attached: the kernel fails the call with ENOSYS.
	for mode, blocked := range map[Mode]string{Refuse: unix.EINVAL.Error(), Zero: unix.ENOSYS.Error()} {
		t.Run(mode.String(), func(t *testing.T) { testFilterInKernel(t, mode, blocked) })
	}
}

func testFilterInKernel(t *testing.T, mode Mode, einval string) {
	const p = 4096
	b := mappings[0].Start
	c := mappings[1].Start
	guarded := []Range{
		{b + 2<<20, b + 4<<20},
		{b + 8<<20, b + 9<<20},
		{0x2fff80000, 0x300080000},
	}
	type tc struct {
		name string
		call
		want string
	}
	cases := []tc{
		{"before", mad(b, p, unix.MADV_DONTNEED), "ok"},
		{"ends at start", mad(b+2<<20-p, p, unix.MADV_DONTNEED), "ok"},
		{"crosses start", mad(b+2<<20-p, 2*p, unix.MADV_DONTNEED), einval},
		{"first page", mad(b+2<<20, p, unix.MADV_DONTNEED), einval},
		{"free inside", mad(b+3<<20, p, unix.MADV_FREE), einval},
		{"dontneed_locked inside", mad(b+3<<20, p, unix.MADV_DONTNEED_LOCKED), einval},
		{"willneed inside", mad(b+3<<20, p, unix.MADV_WILLNEED), "ok"},
		{"cold inside", mad(b+3<<20, p, unix.MADV_COLD), "ok"},
		{"last page", mad(b+4<<20-p, p, unix.MADV_DONTNEED), einval},
		{"at end", mad(b+4<<20, p, unix.MADV_DONTNEED), "ok"},
		{"gap", mad(b+4<<20, 4<<20, unix.MADV_DONTNEED), "ok"},
		{"gap into second", mad(b+4<<20, 4<<20+p, unix.MADV_DONTNEED), einval},
		{"covers all", mad(b, 16<<20, unix.MADV_DONTNEED), einval},
		{"after", mad(b+9<<20, 7<<20, unix.MADV_DONTNEED), "ok"},
		{"zero length inside", mad(b+3<<20, 0, unix.MADV_DONTNEED), "ok"},
		{"carry: crosses 4G start", mad(c, 0x100000, unix.MADV_DONTNEED), einval},
		{"carry: below", mad(c, 0x80000, unix.MADV_DONTNEED), "ok"},
		{"carry: above", mad(0x300080000, 0x80000, unix.MADV_DONTNEED), "ok"},
		{"carry: high half inside", mad(0x300000000, p, unix.MADV_DONTNEED), einval},
	}
	// mremap: a growth maps the file's bytes after the old range, a move
	// takes memory out of the guarded addresses (see Program).
	const mm, fixed, dontunmap = unix.MREMAP_MAYMOVE, unix.MREMAP_MAYMOVE | unix.MREMAP_FIXED, unix.MREMAP_MAYMOVE | unix.MREMAP_DONTUNMAP
	both := func(refuse, zero string) string {
		if mode == Refuse {
			return refuse
		}
		return zero
	}
	mcases := []tc{
		{"mremap: shrink inside", call{Addr: b + 2<<20, Len: 2 * p, NewLen: p}, "ok"},
		{"mremap: shrink inside, may move", call{Addr: b + 2<<20, Len: 2 * p, NewLen: p, Flags: mm}, "ok"},
		{"mremap: grow outside", call{Addr: b, Len: p, NewLen: 2 * p, Flags: mm}, "ok"},
		{"mremap: grow into a range", call{Addr: b + 2<<20 - p, Len: p, NewLen: 2 * p, Flags: mm}, einval},
		{"mremap: grow a range's last page", call{Addr: b + 4<<20 - p, Len: p, NewLen: 2 * p, Flags: mm}, both("ok", einval)},
		{"mremap: grow a range's first page", call{Addr: b + 2<<20, Len: p, NewLen: 2 * p, Flags: mm}, einval},
		{"mremap: move a range's page", call{Addr: b + 3<<20, Len: p, NewLen: p, Flags: fixed, NewAddr: target}, einval},
		{"mremap: copy a range's page", call{Addr: b + 3<<20, Len: p, NewLen: p, Flags: dontunmap}, einval},
		{"mremap: move outside", call{Addr: b + 5<<20, Len: p, NewLen: p, Flags: fixed, NewAddr: target}, "ok"},
		{"mremap: shrink-move a range", call{Addr: b + 3<<20, Len: 2 * p, NewLen: p, Flags: fixed, NewAddr: target}, einval},
		{"mremap: grow-move ending before a range", call{Addr: b + 1<<20, Len: p, NewLen: 1<<20 - p, Flags: fixed, NewAddr: target}, "ok"},
		{"mremap: carry: grow across 4G into a range", call{Addr: c, Len: 0x40000, NewLen: 0x100000, Flags: mm}, einval},
	}
	cases = append(cases, mcases...)
	req := childReq{Ranges: guarded, Mode: mode}
	for _, c := range cases {
		req.Calls = append(req.Calls, c.call)
	}
	// Random calls against the reference definition of "intersects".
	rng := rand.New(rand.NewPCG(1, 2))
	for range 400 {
		m := mappings[rng.IntN(len(mappings))]
		pages := (m.End - m.Start) / p
		a := rng.Uint64N(pages)
		n := rng.Uint64N(pages-a) + 1
		req.Calls = append(req.Calls, mad(m.Start+a*p, n*p, unix.MADV_DONTNEED))
	}
	nFixed := len(req.Calls) // the fixed cases and the random madvise calls
	for range 200 {
		m := mappings[rng.IntN(len(mappings))]
		pages := (m.End - m.Start) / p
		a := rng.Uint64N(pages)
		o := rng.Uint64N(pages-a) + 1
		n := rng.Uint64N(2*o) + 1
		c := call{Addr: m.Start + a*p, Len: o * p, NewLen: n * p, Flags: mm}
		switch rng.IntN(3) {
		case 1:
			c.Flags, c.NewAddr = fixed, target
		case 2:
			if n == o {
				c.Flags = dontunmap
			}
		}
		req.Calls = append(req.Calls, c)
	}
	res := runChild(t, req)
	for i, r := range res {
		var want, name string
		c := req.Calls[i]
		switch {
		case i < len(cases):
			want, name = cases[i].want, cases[i].name
		case i < nFixed:
			want, name = "ok", fmt.Sprintf("random madvise %#x+%#x", c.Addr, c.Len)
			if intersects(guarded, c.Addr, c.Len) {
				want = einval
			}
		default:
			want, name = "ok", fmt.Sprintf("random mremap %#x+%#x to %#x flags %#x", c.Addr, c.Len, c.NewLen, c.Flags)
			move := c.Flags&mremapMoves != 0
			grow := c.NewLen > c.Len
			hit := intersects(guarded, c.Addr, max(c.Len, c.NewLen))
			if mode == Refuse && !move {
				hit = grow && intersects(guarded, c.Addr+c.Len, c.NewLen-c.Len)
			}
			if (move || grow) && hit {
				want = einval
			}
		}
		if r != want {
			t.Errorf("%s: returned %q, want %q", name, r, want)
		}
	}
}

func TestEmptyGuardAllowsAll(t *testing.T) {
	b := mappings[0].Start
	res := runChild(t, childReq{Calls: []call{mad(b, 16<<20, unix.MADV_DONTNEED), mad(b, 4096, unix.MADV_FREE)}})
	if !reflect.DeepEqual(res, []string{"ok", "ok"}) {
		t.Fatalf("got %v", res)
	}
}

func TestCompact(t *testing.T) {
	got := Compact([]Range{{0x5000, 0x6000}, {0x1000, 0x2000}, {0x2000, 0x3000}, {0x9000, 0x9000}, {0x400000, 0x500000}})
	want := []Range{{0x1000, 0x6000}, {0x400000, 0x500000}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Compact = %v, want %v", got, want)
	}
	var many []Range
	for i := range uint64(500) {
		many = append(many, Range{i << 24, i<<24 + 4096})
	}
	got = Compact(many)
	if len(got) != MaxRanges || got[0].Start != 0 || got[len(got)-1].End != 499<<24+4096 {
		t.Fatalf("Compact of 500 far ranges: %d ranges %v..%v", len(got), got[0], got[len(got)-1])
	}
	for _, r := range many {
		if !intersects(got, r.Start, r.End-r.Start) {
			t.Fatalf("range %v lost by Compact", r)
		}
	}
}

func TestProgramRoundTrip(t *testing.T) {
	rs := []Range{{0x1000, 0x3000}, {0x7f0000000000, 0x7f0000400000}}
	var b []byte
	for _, mode := range []Mode{Refuse, Zero} {
		prog, err := Program(rs, mode)
		if err != nil {
			t.Fatal(err)
		}
		b = encode(prog)
		if !isGuard(b) {
			t.Fatal("our program is not recognised as a guard")
		}
		got, gotMode, err := guardRanges(b)
		if err != nil || !reflect.DeepEqual(got, rs) || gotMode != mode {
			t.Fatalf("guardRanges = %v, %v, %v; want %v, %v", got, gotMode, err, rs, mode)
		}
	}
	many := make([]Range, 0, 500)
	for i := range uint64(500) {
		many = append(many, Range{i << 30, i<<30 + 4096})
	}
	if _, err := Program(many, Refuse); err != nil {
		t.Fatalf("Program of %d ranges: %v", len(many), err)
	}
	if _, err := decode(b[:len(b)-3]); err == nil {
		t.Fatal("decode of a torn filter did not fail")
	}
}

func TestBadImageDir(t *testing.T) {
	dir := t.TempDir()
	if err := Apply(dir, nil); err == nil {
		t.Fatal("Apply on an empty dir did not fail")
	}
	os.WriteFile(dir+"/pstree.img", []byte{1, 2}, 0o600)
	err := Apply(dir, nil)
	if err == nil {
		t.Fatal("Apply on a garbage pstree.img did not fail")
	}
	if b, _ := os.ReadFile(dir + "/pstree.img"); len(b) != 2 {
		t.Fatal("Apply changed a bad image")
	}
	_ = errors.Unwrap(err)
}

// mad is a madvise call.
func mad(addr, n uint64, advice int) call { return call{Addr: addr, Len: n, Advice: advice} }

func TestUncovered(t *testing.T) {
	guard := func(mode Mode, rs ...Range) []byte {
		prog, err := Program(rs, mode)
		if err != nil {
			t.Fatal(err)
		}
		return encode(prog)
	}
	heap := Range{0x7f0000000000, 0x7f0010000000} // 256 MiB, moved at the first call
	more := Range{0x7f0010000000, 0x7f0010200000} // grown since, moved later
	patch := Range{heap.Start + 0x5000, heap.Start + 0x6000}
	notOurs := guard(Refuse, heap)
	notOurs[4] ^= 0xff // the same program without our magic
	// Our magic and ranges, but a body that lets every call through: what
	// a process could install to make a move skip its guard.
	forged := guard(Refuse, heap)
	copy(forged[8*2:], encode([]unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW}}))
	if _, _, err := guardRanges(forged); err != nil {
		t.Fatalf("the forged guard does not even parse: %v", err)
	}
	chain := [][]byte{guard(Refuse, more), notOurs, guard(Refuse, heap)}
	one := func(filters ...[]byte) [][][]byte { return [][][]byte{filters} }
	for _, c := range []struct {
		name   string
		chains [][][]byte
		mode   Mode
		rs     []Range
		want   []Range // uncovered
	}{
		{"patches inside the heap", one(chain...), Refuse, []Range{patch, {heap.End - 0x1000, heap.End}}, nil},
		{"a patch across two guards' ranges", one(chain...), Refuse, []Range{{heap.End - 0x1000, more.Start + 0x1000}}, nil},
		{"nothing to guard", nil, Refuse, nil, nil},
		{"no filter", one(), Refuse, []Range{heap}, []Range{heap}},
		{"no thread read", nil, Refuse, []Range{heap}, []Range{heap}},
		{"memory beyond every guard", one(chain...), Refuse, []Range{patch, {more.End, more.End + 0x1000}}, []Range{{more.End, more.End + 0x1000}}},
		{"another mode's guard", one(chain...), Zero, []Range{patch}, []Range{patch}},
		{"a zero-mode guard", one(guard(Zero, heap)), Zero, []Range{patch}, nil},
		{"a filter without our magic", one(notOurs), Refuse, []Range{patch}, []Range{patch}},
		{"a forged guard", one(forged), Refuse, []Range{patch}, []Range{patch}},
		{"a thread without the guard", [][][]byte{chain, {notOurs}}, Refuse, []Range{patch}, []Range{patch}},
		{"every thread guarded", [][][]byte{chain, {guard(Refuse, heap)}}, Refuse, []Range{patch}, nil},
	} {
		if got := Uncovered(c.chains, c.mode, c.rs); !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: Uncovered = %v, want %v", c.name, got, c.want)
		}
	}
}
