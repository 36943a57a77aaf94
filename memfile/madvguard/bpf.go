package madvguard

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"fmt"
	"slices"

	"golang.org/x/sys/unix"
)

// Range is a half-open address range [Start, End) of a process.
type Range struct {
	Start, End uint64
}

func (r Range) String() string { return fmt.Sprintf("%#x-%#x", r.Start, r.End) }

// MaxRanges bounds the ranges one filter checks (12 BPF instructions each).
const MaxRanges = 64

// MergeGap is the largest gap Compact closes unconditionally. A call inside
// a closed gap is refused too, which only keeps that memory resident.
const MergeGap = 1 << 20

// Advice values the guard refuses inside the ranges.
var guardedAdvice = []uint32{unix.MADV_DONTNEED, unix.MADV_FREE, unix.MADV_DONTNEED_LOCKED}

// magic is the K of the guard's first instruction (a load of an immediate
// that the next instruction overwrites): it names the filter as ours, so a
// copy of a copy replaces it instead of stacking a second one. magicV1
// marks the first layout (madvise only, range blocks at headerV1); a
// magic guard's second instruction loads the index of its first range
// block.
const (
	magic   = 0x4c464d32 // "LFM2": madvise and mremap
	magicV1 = 0x4c464d47 // "LFMG": madvise only
)

// mremapMoves are the mremap flags that move a mapping whatever the sizes.
const mremapMoves = unix.MREMAP_FIXED | unix.MREMAP_DONTUNMAP

// seccomp_data offsets (little endian x86-64).
const (
	offNr     = 0
	offArch   = 4
	offArg0Lo = 16 // addr
	offArg0Hi = 20
	offArg1Lo = 24 // len
	offArg1Hi = 28
	offArg2Lo = 32 // madvise: advice (an int: the low word is all the kernel reads); mremap: new_len
	offArg2Hi = 36
	offArg3Lo = 40 // mremap: flags (an int)
)

// Scratch memory slots.
const (
	mAddrLo = 0
	mAddrHi = 1
	mEndLo  = 2
	mEndHi  = 3
)

const (
	retAllow = unix.SECCOMP_RET_ALLOW
	retBlock = unix.SECCOMP_RET_ERRNO | uint32(unix.EINVAL)
	retTrace = unix.SECCOMP_RET_TRACE | traceData
)

// traceData tags the guard's SECCOMP_RET_TRACE stops (PTRACE_GETEVENTMSG).
const traceData = 0x4c46

// Mode is what the guard does with a purging madvise on a guarded range.
type Mode int

const (
	// Refuse fails the call with EINVAL: the allocator keeps the memory and
	// clears it itself (jemalloc memsets; glibc and mimalloc ignore it).
	Refuse Mode = iota
	// Zero stops the call for a Supervisor (SECCOMP_RET_TRACE), which turns
	// it into a fresh anonymous mapping of the range: true zero semantics,
	// memory given back. With no supervisor attached the call fails with
	// ENOSYS, which allocators treat like Refuse.
	Zero
)

func (m Mode) String() string {
	switch m {
	case Refuse:
		return "refuse"
	case Zero:
		return "zero"
	}
	return fmt.Sprintf("mode(%d)", int(m))
}

// ParseMode parses "refuse" or "zero".
func ParseMode(s string) (Mode, error) {
	switch s {
	case "refuse", "":
		return Refuse, nil
	case "zero":
		return Zero, nil
	}
	return 0, fmt.Errorf("madvguard: unknown mode %q (want refuse or zero)", s)
}

// Compact sorts the ranges, drops empty ones, merges overlapping, touching
// and nearby (gap < MergeGap) ones, then closes the smallest gaps until at
// most MaxRanges remain.
func Compact(in []Range) []Range {
	out := joinNear(in, MergeGap)
	for len(out) > MaxRanges {
		best := 0
		for i := 1; i < len(out)-1; i++ {
			if out[i+1].Start-out[i].End < out[best+1].Start-out[best].End {
				best = i
			}
		}
		out[best].End = out[best+1].End
		out = slices.Delete(out, best+1, best+2)
	}
	return out
}

// asm is a tiny classic BPF assembler with forward labels.
type asm struct {
	ins    []unix.SockFilter
	labels map[string]int
	fix    []fixup
	err    error
}

type fixup struct {
	at     int
	jt, jf string
	k      string // an unconditional jump's target
}

func (a *asm) op(code uint16, k uint32) {
	a.ins = append(a.ins, unix.SockFilter{Code: code, K: k})
}

// jmp emits a conditional jump; "" means the next instruction.
func (a *asm) jmp(code uint16, k uint32, jt, jf string) {
	a.fix = append(a.fix, fixup{at: len(a.ins), jt: jt, jf: jf})
	a.op(code, k)
}

// jump emits an unconditional jump to a label.
func (a *asm) jump(to string) {
	a.fix = append(a.fix, fixup{at: len(a.ins), k: to})
	a.op(ja, 0)
}

func (a *asm) label(name string) {
	if _, dup := a.labels[name]; dup {
		a.err = fmt.Errorf("bpf: label %q defined twice", name)
	}
	a.labels[name] = len(a.ins)
}

func (a *asm) assemble() ([]unix.SockFilter, error) {
	if a.err != nil {
		return nil, a.err
	}
	for _, f := range a.fix {
		if f.k != "" {
			to, ok := a.labels[f.k]
			if !ok || to <= f.at {
				return nil, fmt.Errorf("bpf: bad jump to %q", f.k)
			}
			a.ins[f.at].K = uint32(to - f.at - 1)
			continue
		}
		for i, l := range []string{f.jt, f.jf} {
			if l == "" {
				continue
			}
			to, ok := a.labels[l]
			if !ok {
				return nil, fmt.Errorf("bpf: undefined label %q", l)
			}
			off := to - f.at - 1
			if off < 0 || off > 255 {
				return nil, fmt.Errorf("bpf: jump to %q out of range (%d)", l, off)
			}
			if i == 0 {
				a.ins[f.at].Jt = uint8(off)
			} else {
				a.ins[f.at].Jf = uint8(off)
			}
		}
	}
	if len(a.ins) > unix.BPF_MAXINSNS {
		return nil, fmt.Errorf("bpf: %d instructions, the kernel takes at most %d", len(a.ins), unix.BPF_MAXINSNS)
	}
	return a.ins, nil
}

const (
	ldAbs    = unix.BPF_LD | unix.BPF_W | unix.BPF_ABS
	ldImm    = unix.BPF_LD | unix.BPF_W | unix.BPF_IMM
	ldMem    = unix.BPF_LD | unix.BPF_W | unix.BPF_MEM
	st       = unix.BPF_ST
	tax      = unix.BPF_MISC | unix.BPF_TAX
	addX     = unix.BPF_ALU | unix.BPF_ADD | unix.BPF_X
	jeqK     = unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K
	jgtK     = unix.BPF_JMP | unix.BPF_JGT | unix.BPF_K
	jgeK     = unix.BPF_JMP | unix.BPF_JGE | unix.BPF_K
	jgeX     = unix.BPF_JMP | unix.BPF_JGE | unix.BPF_X
	jgtX     = unix.BPF_JMP | unix.BPF_JGT | unix.BPF_X
	jeqX     = unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_X
	jsetK    = unix.BPF_JMP | unix.BPF_JSET | unix.BPF_K
	ja       = unix.BPF_JMP | unix.BPF_JA
	retK     = unix.BPF_RET | unix.BPF_K
	headerV1 = 33 // instructions before the first range block (magicV1)
	block    = 12 // instructions per range block
)

// Program builds the guard for one process's ranges (compacted here). An
// empty list gives a filter that allows everything.
//
// It stops two calls whose range [addr, end) intersects a guarded range:
//   - madvise(addr, len, advice) with a purging advice: [addr, addr+len);
//   - mremap(addr, old, new, flags): a copy's memory at these addresses is
//     a mapping of a memory file whose offsets run on past each part, so a
//     growth maps the file's bytes at the offsets after the old range
//     (another part's data, where anonymous memory reads zeros), and a moved
//     part leaves the guarded addresses. In Refuse mode: a move by flag
//     (MREMAP_FIXED, MREMAP_DONTUNMAP) on [addr, addr+max(old, new)), a
//     growth on [addr+old, addr+new). In Zero mode, any growth or move on
//     [addr, addr+max(old, new)): the supervisor turns the memory-file part
//     of the old range into anonymous memory first (same bytes), then lets
//     the call run. A shrink in place is never stopped.
func Program(ranges []Range, mode Mode) ([]unix.SockFilter, error) {
	ret := uint32(retBlock)
	switch mode {
	case Refuse:
	case Zero:
		ret = retTrace
	default:
		return nil, fmt.Errorf("madvguard: bad mode %d", mode)
	}
	rs := Compact(ranges)
	a := &asm{labels: map[string]int{}}
	a.op(ldImm, magic)
	a.op(ldImm, 0) // index of the first range block, set below
	a.op(ldAbs, offArch)
	a.jmp(jeqK, unix.AUDIT_ARCH_X86_64, "", "allow")
	a.op(ldAbs, offNr)
	a.jmp(jeqK, unix.SYS_MADVISE, "madvise", "")
	a.jmp(jeqK, unix.SYS_MREMAP, "mremap", "allow")

	a.label("madvise")
	a.op(ldAbs, offArg2Lo)
	a.jmp(jeqK, guardedAdvice[0], "adv", "")
	a.jmp(jeqK, guardedAdvice[1], "adv", "")
	a.jmp(jeqK, guardedAdvice[2], "adv", "allow")
	a.label("adv")
	// len == 0 is a successful no-op for the kernel: let it through.
	a.op(ldAbs, offArg1Lo)
	a.jmp(jeqK, 0, "", "old")
	a.op(ldAbs, offArg1Hi)
	a.jmp(jeqK, 0, "allow", "old")

	a.label("mremap")
	// new > old (64-bit)?
	a.op(ldAbs, offArg1Hi)
	a.op(tax, 0)
	a.op(ldAbs, offArg2Hi)
	a.jmp(jgtX, 0, "grow", "")
	a.jmp(jeqX, 0, "", "nogrow")
	a.op(ldAbs, offArg1Lo)
	a.op(tax, 0)
	a.op(ldAbs, offArg2Lo)
	a.jmp(jgtX, 0, "grow", "nogrow")
	a.label("nogrow")
	a.op(ldAbs, offArg3Lo)
	a.jmp(jsetK, mremapMoves, "old", "allow")
	a.label("grow")
	if mode == Refuse {
		a.op(ldAbs, offArg3Lo)
		a.jmp(jsetK, mremapMoves, "new", "")
		// [addr+old, addr+new)
		a.sum(offArg0Lo, offArg0Hi, offArg1Lo, offArg1Hi, mAddrLo, mAddrHi)
		a.sum(offArg0Lo, offArg0Hi, offArg2Lo, offArg2Hi, mEndLo, mEndHi)
		a.jump("r0")
	}
	a.label("new") // [addr, addr+new)
	a.arg(offArg0Lo, offArg0Hi, mAddrLo, mAddrHi)
	a.sum(offArg0Lo, offArg0Hi, offArg2Lo, offArg2Hi, mEndLo, mEndHi)
	a.jump("r0")
	// Classic BPF jumps forward only, and the kernel's check of the scratch
	// slots takes a ret's successor for reachable from it: the slots are
	// written on the way into the range blocks, after this ret.
	a.label("allow")
	a.op(retK, retAllow)
	a.label("old") // [addr, addr+len) of madvise, [addr, addr+old) of mremap
	a.arg(offArg0Lo, offArg0Hi, mAddrLo, mAddrHi)
	a.sum(offArg0Lo, offArg0Hi, offArg1Lo, offArg1Hi, mEndLo, mEndHi)
	// Ranges ascend: once end <= start of a range, no later range can match.
	for i, r := range rs {
		next := fmt.Sprintf("r%d", i+1)
		in, allow, blk := fmt.Sprintf("in%d", i), fmt.Sprintf("allow%d", i), fmt.Sprintf("block%d", i)
		sHi, sLo := uint32(r.Start>>32), uint32(r.Start)
		eHi, eLo := uint32(r.End>>32), uint32(r.End)
		a.label(fmt.Sprintf("r%d", i))
		a.op(ldMem, mEndHi)
		a.jmp(jgtK, sHi, in, "")
		a.jmp(jeqK, sHi, "", allow)
		a.op(ldMem, mEndLo)
		a.jmp(jgtK, sLo, in, allow)
		a.label(allow)
		a.op(retK, retAllow)
		a.label(in) // end > start: blocked unless addr >= end of range
		a.op(ldMem, mAddrHi)
		a.jmp(jgtK, eHi, next, "")
		a.jmp(jeqK, eHi, "", blk)
		a.op(ldMem, mAddrLo)
		a.jmp(jgeK, eLo, next, blk)
		a.label(blk)
		a.op(retK, ret)
	}
	a.label(fmt.Sprintf("r%d", len(rs)))
	a.op(retK, retAllow)
	prog, err := a.assemble()
	if err != nil {
		return nil, err
	}
	prog[1].K = uint32(a.labels["r0"])
	return prog, nil
}

// arg stores a 64-bit argument in two scratch slots.
func (a *asm) arg(lo, hi uint32, mLo, mHi uint32) {
	a.op(ldAbs, lo)
	a.op(st, mLo)
	a.op(ldAbs, hi)
	a.op(st, mHi)
}

// sum stores the 64-bit sum of two arguments in two scratch slots (the
// carry out of the high word is lost, as the kernel's own range check
// would refuse such a range).
func (a *asm) sum(aLo, aHi, bLo, bHi uint32, mLo, mHi uint32) {
	nc := fmt.Sprintf("nocarry%d", len(a.ins))
	a.op(ldAbs, aLo)
	a.op(tax, 0)
	a.op(ldAbs, bLo)
	a.op(addX, 0)
	a.op(st, mLo)
	a.jmp(jgeX, 0, nc, "") // sum >= a: no carry
	a.op(ldImm, 1)
	a.op(ja, 1)
	a.label(nc)
	a.op(ldImm, 0)
	a.op(tax, 0) // X = carry
	a.op(ldAbs, bHi)
	a.op(addX, 0)
	a.op(tax, 0) // X = b_hi + carry
	a.op(ldAbs, aHi)
	a.op(addX, 0)
	a.op(st, mHi)
}

// encode gives the bytes CRIU stores in seccomp.img (struct sock_filter).
func encode(prog []unix.SockFilter) []byte {
	b := make([]byte, 0, 8*len(prog))
	for _, in := range prog {
		b = binary.LittleEndian.AppendUint16(b, in.Code)
		b = append(b, in.Jt, in.Jf)
		b = binary.LittleEndian.AppendUint32(b, in.K)
	}
	return b
}

func decode(b []byte) ([]unix.SockFilter, error) {
	if len(b)%8 != 0 {
		return nil, fmt.Errorf("seccomp filter of %d bytes is not a whole number of instructions", len(b))
	}
	prog := make([]unix.SockFilter, len(b)/8)
	for i := range prog {
		p := b[8*i:]
		prog[i] = unix.SockFilter{Code: binary.LittleEndian.Uint16(p), Jt: p[2], Jf: p[3], K: binary.LittleEndian.Uint32(p[4:])}
	}
	return prog, nil
}

// isGuard reports whether a stored filter is one of ours (either layout).
func isGuard(b []byte) bool {
	if len(b) < 8 || binary.LittleEndian.Uint16(b) != ldImm {
		return false
	}
	m := binary.LittleEndian.Uint32(b[4:])
	return m == magic || m == magicV1
}

// maxChainInsns is the kernel's bound on the instructions of a thread's
// seccomp filters together, each counting 4 more (MAX_INSNS_PER_PATH).
const maxChainInsns = 32768

// Fits reports whether every thread of chains (as Uncovered reads them) can
// take prog as one more filter: past the bound the kernel refuses it
// (ENOMEM), so memory that only a new guard would cover is better left where
// it is than moved without one.
func Fits(chains [][][]byte, prog []unix.SockFilter) bool {
	add := ebpfPrologue
	for _, ins := range prog {
		add += ebpfLen(ins.Code, ins.Jt, ins.Jf, ins.K)
	}
	for _, filters := range chains {
		n := add
		for _, f := range filters {
			n += ebpfPrologue + 4
			for i := 0; i+8 <= len(f); i += 8 {
				n += ebpfLen(binary.LittleEndian.Uint16(f[i:]), f[i+2], f[i+3], binary.LittleEndian.Uint32(f[i+4:]))
			}
		}
		if n > maxChainInsns {
			return false
		}
	}
	return true
}

// The kernel counts a filter by its length once converted to eBPF (what
// runs: bpf_convert_filter), not by the classic instructions it was given:
// a prologue (A and X cleared, the context kept) and, per instruction, one,
// except a return of a constant (a move and an exit), a division or modulo
// by X (checked for zero: five), and a conditional jump: one more for a
// constant that is negative as an int32 (moved into a register first), and
// one more unless its false branch is the next instruction or its true one
// is and the test inverts (equal, greater, greater or equal).
const ebpfPrologue = 3

func ebpfLen(code uint16, jt, jf uint8, k uint32) int {
	switch code & 0x07 {
	case unix.BPF_RET:
		if code&0x18 == unix.BPF_K {
			return 2
		}
	case unix.BPF_ALU:
		if op := code & 0xf0; (op == unix.BPF_DIV || op == unix.BPF_MOD) && code&0x08 == unix.BPF_X {
			return 5
		}
	case unix.BPF_JMP:
		op := code & 0xf0
		if op == unix.BPF_JA {
			return 1
		}
		n := 1
		if code&0x08 == unix.BPF_K && int32(k) < 0 {
			n++
		}
		invertible := op == unix.BPF_JEQ || op == unix.BPF_JGT || op == unix.BPF_JGE
		if jf != 0 && !(jt == 0 && invertible) {
			n++
		}
		return n
	}
	return 1
}

// Uncovered returns the ranges of rs that the guards of the given mode do
// not already cover on every thread: chains holds each thread's seccomp
// filters as the kernel stores them (8-byte instructions, as
// PTRACE_SECCOMP_GET_FILTER returns them). A live process cannot drop a
// filter: a move that installed a guard for every patch would stack one per
// move, until the kernel's limit on a chain's instructions (32768, about 30
// guards of 64 ranges) failed the next. A filter counts only if it is
// byte for byte the guard Program makes of the ranges it names: one the
// process made itself, with our magic and a body that lets calls through,
// counts for nothing.
func Uncovered(chains [][][]byte, mode Mode, rs []Range) []Range {
	var perThread [][]Range
	for _, filters := range chains {
		var have []Range
		for _, f := range filters {
			if grs, ok := genuineGuard(f, mode); ok {
				have = append(have, grs...)
			}
		}
		perThread = append(perThread, joinNear(have, 0))
	}
	var out []Range
	for _, r := range rs {
		if r.End <= r.Start {
			continue
		}
		if len(perThread) == 0 || slices.ContainsFunc(perThread, func(have []Range) bool { return !within(have, r) }) {
			out = append(out, r)
		}
	}
	return out
}

// genuineGuard returns the ranges of f if it is exactly the guard of mode
// that Program makes of them.
func genuineGuard(f []byte, mode Mode) ([]Range, bool) {
	if !isGuard(f) {
		return nil, false
	}
	rs, m, err := guardRanges(f)
	if err != nil || m != mode {
		return nil, false
	}
	prog, err := Program(rs, mode)
	if err != nil || !bytes.Equal(encode(prog), f) {
		return nil, false
	}
	return rs, true
}

// within reports whether r lies inside one range of have (sorted, joined).
func within(have []Range, r Range) bool {
	i, _ := slices.BinarySearchFunc(have, r.Start, func(h Range, a uint64) int {
		switch {
		case h.End <= a:
			return -1
		case h.Start > a:
			return 1
		}
		return 0
	})
	return i < len(have) && have[i].Start <= r.Start && r.End <= have[i].End
}

// joinNear drops empty ranges, sorts the others and joins those that
// overlap or lie less than gap apart (touching ones too).
func joinNear(in []Range, gap uint64) []Range {
	rs := make([]Range, 0, len(in))
	for _, r := range in {
		if r.End > r.Start {
			rs = append(rs, r)
		}
	}
	slices.SortFunc(rs, func(a, b Range) int { return cmp.Compare(a.Start, b.Start) })
	var out []Range
	for _, r := range rs {
		if n := len(out); n > 0 && r.Start <= out[n-1].End+gap {
			out[n-1].End = max(out[n-1].End, r.End)
			continue
		}
		out = append(out, r)
	}
	return out
}

// guardRanges reads the ranges and the mode back out of one of our filters.
func guardRanges(b []byte) ([]Range, Mode, error) {
	prog, err := decode(b)
	if err != nil {
		return nil, 0, err
	}
	header := headerV1
	if prog[0].K == magic {
		if len(prog) < 2 {
			return nil, 0, fmt.Errorf("guard filter of %d instructions has an unknown layout", len(prog))
		}
		header = int(prog[1].K)
	}
	if len(prog) < header+1 || (len(prog)-header-1)%block != 0 {
		return nil, 0, fmt.Errorf("guard filter of %d instructions has an unknown layout", len(prog))
	}
	mode := Refuse
	var rs []Range
	for i := header; i+block <= len(prog); i += block {
		p := prog[i:]
		rs = append(rs, Range{
			Start: uint64(p[1].K)<<32 | uint64(p[4].K),
			End:   uint64(p[7].K)<<32 | uint64(p[10].K),
		})
		if p[11].K == retTrace {
			mode = Zero
		}
	}
	return rs, mode, nil
}
