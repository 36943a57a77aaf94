package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/lazyfork/lazyfork/internal/workloads"
)

var errHelp = errors.New("help")

type config struct {
	cmd         []string
	workload    workloads.Kind
	heapMiB     int
	pid         int
	settle      time.Duration
	n           int
	generations int
	store       string
	family      string
	work        string
	tmpfsSize   int64
	plain       bool
	guard       bool
	keep        bool
	verify      bool
	criu        string
}

const usage = `Usage: lazyfork-memfile [--cmd "PROG ARGS" | --workload c|python|go | --pid PID] [flags]

Runs LazyFork's memory loop on a plain process tree and reports what it cost:

  1. start the workload as PID 1 of a new PID namespace (or take --pid),
  2. dump it with CRIU, leaving it running,
  3. rewrite the dump: its private memory moves into files of a family on a tmpfs,
     the image keeps only what is left (registers, files, stacks...); unless
     --guard=false, the snapshot also gets madvguard's filter (purging madvise
     calls on memory-file ranges fail in copies, so allocators never take the
     file's bytes for zeros),
  4. restore -n copies at once, each in its own PID namespace, each mapping the
     family's files copy-on-write,
  5. with --generations K, dump copy 0 of the last generation and repeat (forks of
     forks: each snapshot writes only the pages its generation changed),
  6. print a table: dump and rewrite time, rewrite throughput, restore time and
     RssAnon / Pss / RssShmem of every copy right after its restore.

Unless --keep is given, the copies are killed (SIGKILL, by PID), the files freed and
the temporary tmpfs unmounted at the end; the workload it started is killed too.
With --keep everything stays after a successful run, and the table says where
(a failed run always cleans up).

Examples:
  lazyfork-memfile --workload c --heap 256 -n 10
  lazyfork-memfile --cmd "python3 -c 'import time; x=bytearray(1<<28); time.sleep(1e9)'" -n 5
  lazyfork-memfile --workload go --generations 9 -n 1
  lazyfork-memfile --workload c --plain -n 3      # plain CRIU, for comparison

--pid works only for a process that is PID 1 of its own PID namespace and leads
its own session, e.g. started with "unshare --pid --fork setsid PROG" (not with
--kill-child: CRIU restores that parent-death signal, and every copy dies as soon
as CRIU exits). Copies of any other process would need the very PIDs the original
still holds, and CRIU cannot dump a namespace whose session leader is outside it.

Flags:
`

func parseFlags(args []string, stderr io.Writer) (*config, error) {
	c := &config{}
	fs := flag.NewFlagSet("lazyfork-memfile", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	var cmd, kind string
	var sizeMiB int64
	fs.StringVar(&cmd, "cmd", "", "run this command as the workload (split like a shell: quotes group words)")
	fs.StringVar(&kind, "workload", "", "run a built-in workload: c (glibc malloc), python (threads + child), go (FreeOSMemory)")
	fs.IntVar(&c.heapMiB, "heap", 256, "heap of the built-in workload, MiB")
	fs.IntVar(&c.pid, "pid", 0, "take this running process tree (PID 1 of its own PID namespace)")
	fs.DurationVar(&c.settle, "settle", 2*time.Second, "let a started workload run this long before the dump")
	fs.IntVar(&c.n, "n", 3, "copies to restore per generation")
	fs.IntVar(&c.generations, "generations", 1, "generations of forks of forks")
	fs.StringVar(&c.store, "store", "", "root of the family store (a tmpfs is mounted there unless it is one); default: a temporary directory")
	fs.StringVar(&c.family, "family", "devtool", "family name in the store")
	fs.StringVar(&c.work, "work", "", "directory for images and the copies' output; default: a temporary directory")
	fs.Int64Var(&sizeMiB, "tmpfs-size", 16384, "size limit of a tmpfs this tool mounts, MiB")
	fs.BoolVar(&c.plain, "plain", false, "skip the rewrite: plain CRIU restores, for comparison")
	fs.BoolVar(&c.guard, "guard", true, "add madvguard's refuse-mode filter to each snapshot: purging madvise on memory files fails in copies (needed by jemalloc and Go 1.26 defaults); --guard=false to leave it out")
	fs.BoolVar(&c.keep, "keep", false, "leave the copies running and their files in place")
	fs.BoolVar(&c.verify, "verify", true, "built-in workloads: ask every copy for a full memory check")
	fs.StringVar(&c.criu, "criu", "", "criu binary (default: criu on PATH, else /usr/local/sbin/criu)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, errHelp
		}
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q (quote the program in --cmd)", fs.Args())
	}
	c.tmpfsSize = sizeMiB << 20
	chosen := 0
	if cmd != "" {
		chosen++
		w, err := splitWords(cmd)
		if err != nil {
			return nil, fmt.Errorf("--cmd: %w", err)
		}
		if len(w) == 0 {
			return nil, errors.New("--cmd is empty")
		}
		c.cmd = w
	}
	if kind != "" {
		chosen++
		c.workload = workloads.Kind(kind)
		ok := false
		for _, k := range workloads.Kinds {
			ok = ok || k == c.workload
		}
		if !ok {
			return nil, fmt.Errorf("--workload %q: want c, python or go", kind)
		}
	}
	if c.pid != 0 {
		chosen++
		if c.pid < 0 {
			return nil, fmt.Errorf("--pid %d: bad pid", c.pid)
		}
	}
	if chosen != 1 {
		return nil, errors.New("give exactly one of --cmd, --workload and --pid (see --help)")
	}
	if c.n < 1 || c.n > 1000 {
		return nil, fmt.Errorf("-n %d: want 1..1000 copies", c.n)
	}
	if c.generations < 1 || c.generations > 100 {
		return nil, fmt.Errorf("--generations %d: want 1..100", c.generations)
	}
	if c.plain {
		c.guard = false // nothing to guard: plain copies hold anonymous memory
	}
	if c.heapMiB < 1 {
		return nil, fmt.Errorf("--heap %d: want at least 1 MiB", c.heapMiB)
	}
	if c.settle < 0 {
		return nil, fmt.Errorf("--settle %v: negative", c.settle)
	}
	return c, nil
}

// splitWords splits a command line the way a shell would for simple cases: blanks
// separate words, single quotes keep everything, double quotes and backslashes work.
func splitWords(s string) ([]string, error) {
	var words []string
	var cur strings.Builder
	inWord, quote := false, rune(0)
	rs := []rune(s)
	for i := 0; i < len(rs); i++ {
		r := rs[i]
		switch {
		case quote == '\'':
			if r == '\'' {
				quote = 0
			} else {
				cur.WriteRune(r)
			}
		case quote == '"':
			if r == '"' {
				quote = 0
			} else if r == '\\' && i+1 < len(rs) && strings.ContainsRune(`"\$`+"`", rs[i+1]) {
				i++
				cur.WriteRune(rs[i])
			} else {
				cur.WriteRune(r)
			}
		case r == '\'' || r == '"':
			quote, inWord = r, true
		case r == '\\':
			if i+1 < len(rs) {
				i++
				cur.WriteRune(rs[i])
				inWord = true
			}
		case r == ' ' || r == '\t' || r == '\n':
			if inWord {
				words = append(words, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteRune(r)
			inWord = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("unterminated %c quote", quote)
	}
	if inWord {
		words = append(words, cur.String())
	}
	return words, nil
}
