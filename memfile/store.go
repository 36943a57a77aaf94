package memfile

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/atomicfile"
	"github.com/lazyfork/lazyfork/internal/procfs"
)

// MountPath is where a container sees its family's memory directory (read-only).
const MountPath = "/.lazyfork/mem"

// FileExt is the extension of memory files.
const FileExt = ".mem"

// tmpPrefix marks a memory file still being written; its writer holds an flock on it.
const tmpPrefix = ".tmp-"

// stateDirName holds per-family locks and references, outside the family
// directories (which containers see).
const stateDirName = ".state"

// Store is the family memory store rooted at one directory (normally on a
// tmpfs, see EnsureTmpfs):
//
//	<root>/<family>/<name>.mem              memory files (0400, immutable)
//	<root>/.views/<view>/<name>.mem         a container's view: links to its lineage's files
//	<root>/.state/<family>/lock             flock serialising changes of a family
//	<root>/.state/<family>/refs/<hash>.json one per holder: what it pins
//	<root>/.state/<family>/owner.json       the family's owner (Claim)
//	<root>/.state/<family>/views/<view>     one per view linking the family's files
//
// Everything is on disk, so any process can open the store, and references
// survive restarts of every process. Safe for concurrent use by many
// processes (flock), and by many goroutines.
type Store struct {
	root string

	sealOnce sync.Once // probes whether files can be sealed here (sealing)
	sealOK   bool

	// faultAt, set by tests only, is called at each fault point of a
	// rewrite (see faultPoints).
	faultAt func(point string) error
}

// OpenStore opens (creating) a store at root.
func OpenStore(root string) (*Store, error) {
	if !filepath.IsAbs(root) {
		return nil, fmt.Errorf("store root %q is not absolute: %w", root, errdefs.ErrInvalidArgument)
	}
	if err := os.MkdirAll(filepath.Join(root, stateDirName), 0o700); err != nil {
		return nil, fmt.Errorf("open store: %w", err)
	}
	return &Store{root: filepath.Clean(root)}, nil
}

// Root returns the store's root directory.
func (s *Store) Root() string { return s.root }

func checkFamily(family string) error {
	if !api.ValidName(family) {
		return fmt.Errorf("bad family name %q: %w", family, errdefs.ErrInvalidArgument)
	}
	return nil
}

// FamilyDir returns the host directory of a family's memory files, creating it.
func (s *Store) FamilyDir(family string) (string, error) {
	if err := checkFamily(family); err != nil {
		return "", err
	}
	dir := filepath.Join(s.root, family)
	var err error
	// A GC removing the family while it is empty can remove a parent
	// between two mkdirs: try again.
	for try := 0; try < 100; try++ {
		if err = os.MkdirAll(dir, 0o755); err != nil {
			err = fmt.Errorf("family dir: %w", err)
		} else if err = os.MkdirAll(s.refsDir(family), 0o700); err != nil {
			err = fmt.Errorf("family state: %w", err)
		}
		if !errors.Is(err, os.ErrNotExist) && !errors.Is(err, os.ErrExist) {
			break
		}
	}
	if err != nil {
		return "", err
	}
	return dir, nil
}

func (s *Store) stateDir(family string) string { return filepath.Join(s.root, stateDirName, family) }
func (s *Store) refsDir(family string) string  { return filepath.Join(s.stateDir(family), "refs") }

// lockFamily takes the family's exclusive lock, creating the family's
// directories; call the returned func to release.
//
// GC removes an empty family's state directory, lock file included, while
// it holds the lock: a waiter that then gets the flock of the removed file
// sees that the path no longer names its inode and locks anew.
func (s *Store) lockFamily(family string) (func(), error) {
	for {
		if _, err := s.FamilyDir(family); err != nil {
			return nil, err
		}
		path := filepath.Join(s.stateDir(family), "lock")
		f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
		if errors.Is(err, os.ErrNotExist) {
			continue // the state directory was just removed by a GC
		}
		if err != nil {
			return nil, fmt.Errorf("lock family %s: %w", family, err)
		}
		for {
			err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
			if !errors.Is(err, unix.EINTR) {
				break
			}
		}
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("lock family %s: %w", family, err)
		}
		var held, now unix.Stat_t
		if unix.Fstat(int(f.Fd()), &held) == nil && unix.Stat(path, &now) == nil && held.Dev == now.Dev && held.Ino == now.Ino {
			// That GC may have removed the directories after our FamilyDir
			// and before we created the new lock file: make them again.
			if _, err := s.FamilyDir(family); err != nil {
				f.Close()
				return nil, err
			}
			return func() { f.Close() }, nil
		}
		f.Close()
	}
}

// holderRecord is one holder's reference, as stored on disk.
type holderRecord struct {
	Holder string   `json:"holder"`
	Files  []string `json:"files"`
	// PIDStart is the start time (clock ticks after boot) of a "pid:" holder's
	// process, so a recycled PID does not keep files alive.
	PIDStart uint64 `json:"pid_start,omitempty"`
	// Bundle is the directory the holder lives with: a "container:"
	// holder's task bundle (RefBundle), or what a claimer names (ClaimHeld:
	// an import's image directory). The holder is dead once that directory
	// is gone from its parent's parent (a task root, ROOT/snapshots).
	Bundle  string    `json:"bundle,omitempty"`
	Updated time.Time `json:"updated"`
}

func (s *Store) refPath(family, holder string) string {
	h := sha256.Sum256([]byte(holder))
	return filepath.Join(s.refsDir(family), hex.EncodeToString(h[:12])+".json")
}

// Holder kinds with a liveness check; any other holder (e.g.
// "container:<ns>/<id>") lives until Unref, or, referenced with RefBundle,
// until its task's bundle is gone.
const (
	HolderSnapshot  = "snapshot:"  // + image dir: dead once its lazyfork.json is gone
	HolderPID       = "pid:"       // + host PID: dead once that process is gone
	HolderContainer = "container:" // + namespace/id: a container's task (RefBundle)
)

// Ref records that holder pins files (base names in the family directory).
// Repeated calls by the same holder add to its set. Every file must exist.
func (s *Store) Ref(family, holder string, files []string) error {
	if holder == "" {
		return fmt.Errorf("ref: empty holder: %w", errdefs.ErrInvalidArgument)
	}
	unlock, err := s.lockFamily(family)
	if err != nil {
		return err
	}
	defer unlock()
	return s.refLocked(family, holder, "", files)
}

// RefBundle is Ref for a container's task (HolderContainer + namespace/id)
// whose bundle is the absolute directory bundle: the reference, and the
// container's view (ViewName), last until Unref, or until GC finds the
// bundle gone. A task whose shim died while creating it may have had no
// delete that dropped them: containerd runs the shim binary's delete in the
// bundle as the failed create removes it.
func (s *Store) RefBundle(family, holder, bundle string, files []string) error {
	if _, ok := holderView(holder); !ok || !filepath.IsAbs(bundle) {
		return fmt.Errorf("ref %q in bundle %q: want a container holder and an absolute bundle: %w", holder, bundle, errdefs.ErrInvalidArgument)
	}
	unlock, err := s.lockFamily(family)
	if err != nil {
		return err
	}
	defer unlock()
	return s.refLocked(family, holder, bundle, files)
}

// holderView is the view of a HolderContainer holder.
func holderView(holder string) (view string, ok bool) {
	nsid, ok := strings.CutPrefix(holder, HolderContainer)
	ns, id, found := strings.Cut(nsid, "/")
	if !ok || !found || ns == "" || id == "" || strings.Contains(id, "/") {
		return "", false
	}
	return ViewName(ns, id), true
}

func (s *Store) refLocked(family, holder, bundle string, files []string) error {
	dir := filepath.Join(s.root, family)
	for _, f := range files {
		if err := checkFileName(f); err != nil {
			return err
		}
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			return fmt.Errorf("ref %s: file %s of family %s: %w", holder, f, family, errdefs.ErrNotFound)
		}
	}
	rec := holderRecord{Holder: holder}
	if old, err := readRecord(s.refPath(family, holder)); err == nil && old.Holder == holder {
		rec = *old
	}
	if bundle != "" {
		rec.Bundle = bundle
	}
	if pidStr, ok := strings.CutPrefix(holder, HolderPID); ok {
		pid, err := strconv.Atoi(pidStr)
		if err != nil || pid <= 0 {
			return fmt.Errorf("ref: bad pid holder %q: %w", holder, errdefs.ErrInvalidArgument)
		}
		start, err := pidStartTime(pid)
		if err != nil {
			return fmt.Errorf("ref %s: %w", holder, err)
		}
		rec.PIDStart = start
	}
	for _, f := range files {
		if !slices.Contains(rec.Files, f) {
			rec.Files = append(rec.Files, f)
		}
	}
	slices.Sort(rec.Files)
	rec.Updated = time.Now().UTC()
	return writeJSONAtomic(s.refPath(family, holder), &rec, 0o600)
}

// Unref drops holder's reference and frees the family's files that nothing
// references any more. Dropping a holder that holds nothing is not an error.
func (s *Store) Unref(family, holder string) error {
	unlock, err := s.lockFamily(family)
	if err != nil {
		return err
	}
	defer unlock()
	if err := os.Remove(s.refPath(family, holder)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("unref %s: %w", holder, err)
	}
	_, err = s.gcLocked(context.Background(), family)
	return err
}

// UnrefMatching drops, in one pass under the family lock, every reference
// whose holder drop matches, and frees what nothing references any more:
// what Unref of each would do, reading the family's references once instead
// of once a holder (a container's release drops several, and a family of
// many forks has many references to read).
func (s *Store) UnrefMatching(family string, drop func(holder string) bool) error {
	unlock, err := s.lockFamily(family)
	if err != nil {
		return err
	}
	defer unlock()
	_, err = s.collectLocked(context.Background(), family, drop)
	return err
}

// Holders returns the live holders of a family and the files each pins.
func (s *Store) Holders(family string) (map[string][]string, error) {
	if err := checkFamily(family); err != nil {
		return nil, err
	}
	recs, err := s.records(family)
	if err != nil {
		return nil, err
	}
	out := map[string][]string{}
	for _, r := range recs {
		if s.alive(family, r) {
			out[r.Holder] = r.Files
		}
	}
	return out, nil
}

func (s *Store) records(family string) (map[string]*holderRecord, error) {
	ents, err := os.ReadDir(s.refsDir(family))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil
		}
		return nil, err
	}
	out := map[string]*holderRecord{}
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		p := filepath.Join(s.refsDir(family), e.Name())
		r, err := readRecord(p)
		if errors.Is(err, os.ErrNotExist) {
			continue // dropped since the listing (Holders takes no lock)
		}
		if err != nil {
			// A torn record cannot happen (atomic writes); an unreadable one
			// is kept and pins nothing we can name, so be safe: fail.
			return nil, fmt.Errorf("reference %s: %w", p, err)
		}
		out[p] = r
	}
	return out, nil
}

func readRecord(path string) (*holderRecord, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var r holderRecord
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrDataLoss)
	}
	return &r, nil
}

// alive reports whether a holder still holds its files.
func (s *Store) alive(family string, r *holderRecord) bool {
	switch {
	// Dead only when known to be: a holder whose record cannot be read for
	// now (EIO, EMFILE) stays; dropping it could free what it still maps.
	case strings.HasPrefix(r.Holder, HolderSnapshot):
		info, err := ReadSnapshot(strings.TrimPrefix(r.Holder, HolderSnapshot))
		switch {
		case err == nil:
			return info.Family == family
		case errdefs.IsNotFound(err), errors.Is(err, unix.ENOTDIR), errdefs.IsDataLoss(err):
			return false // gone, or no snapshot any more
		}
		return true
	case strings.HasPrefix(r.Holder, HolderPID):
		pid, err := strconv.Atoi(strings.TrimPrefix(r.Holder, HolderPID))
		if err != nil {
			return false
		}
		start, err := pidStartTime(pid)
		if err != nil {
			return !errdefs.IsNotFound(err) // gone, or a zombie
		}
		return start == r.PIDStart
	case r.Bundle != "":
		// Dead only where the directory holding the bundle (containerd's
		// <state>/io.containerd.runtime.v2.task for a task) is seen without
		// it: a process that does not see containerd's state (another mount
		// namespace) must not take every task for gone.
		if _, err := os.Stat(filepath.Dir(filepath.Dir(r.Bundle))); err != nil {
			return true
		}
		_, err := os.Stat(r.Bundle)
		return !errors.Is(err, os.ErrNotExist)
	}
	return true
}

// pidStartTime is the start time of a live (not zombie) process.
func pidStartTime(pid int) (uint64, error) {
	st, err := procfs.ReadStat(pid)
	if err != nil {
		return 0, err
	}
	if st.Zombie() {
		return 0, fmt.Errorf("process %d is a zombie: %w", pid, errdefs.ErrNotFound)
	}
	return st.StartTime, nil
}

func checkFileName(f string) error {
	if f == "" || strings.ContainsRune(f, '/') || strings.HasPrefix(f, ".") || !strings.HasSuffix(f, FileExt) {
		return fmt.Errorf("bad memory file name %q: %w", f, errdefs.ErrInvalidArgument)
	}
	return nil
}

// GC frees, in every family, the memory files that no live holder references
// and no process maps, drops dead holders, and removes memory files left
// half-written by a writer that died. A family left with no files, no
// holders and no views is removed with its state (owner included). It may
// be called at any time; a cancelled ctx stops it between families.
func (s *Store) GC(ctx context.Context) ([]string, error) {
	ents, err := os.ReadDir(s.root)
	if err != nil {
		return nil, err
	}
	// Families are the directories of the root and of .state (a state
	// directory can outlive its family directory).
	states, _ := os.ReadDir(filepath.Join(s.root, stateDirName))
	families := map[string]bool{}
	for _, e := range append(ents, states...) {
		if e.IsDir() && checkFamily(e.Name()) == nil {
			families[e.Name()] = true
		}
		if strings.HasPrefix(e.Name(), sealProbePrefix) {
			// Left by a process that died while probing.
			removeSealed(filepath.Join(s.root, stateDirName, e.Name()))
		}
	}
	var freed []string
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(families)) {
		if err := ctx.Err(); err != nil {
			errs = append(errs, err)
			break
		}
		unlock, err := s.lockFamily(name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		f, err := s.gcLocked(ctx, name)
		unlock()
		freed = append(freed, f...)
		if err != nil {
			errs = append(errs, err)
		}
	}
	return freed, errors.Join(errs...)
}

// gcLocked collects one family. Preconditions: the family lock is held.
func (s *Store) gcLocked(ctx context.Context, family string) ([]string, error) {
	return s.collectLocked(ctx, family, nil)
}

// collectLocked is gcLocked that first drops the references whose holder
// drop (if set) matches. Preconditions: the family lock is held.
func (s *Store) collectLocked(ctx context.Context, family string, drop func(holder string) bool) ([]string, error) {
	recs, err := s.records(family)
	if err != nil {
		return nil, err
	}
	pinned := map[string]bool{}
	holders := 0
	for path, r := range recs {
		if drop != nil && drop(r.Holder) {
			if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
				return nil, fmt.Errorf("unref %s: %w", r.Holder, err)
			}
			continue
		}
		if !s.alive(family, r) {
			log.G(ctx).WithField("family", family).WithField("holder", r.Holder).Debug("memfile: dropping dead holder")
			if view, ok := holderView(r.Holder); ok && r.Bundle != "" {
				// Its task is gone: so is every use of its view, whose
				// links would keep the files it pins.
				if err := RemoveAll(s.ViewDir(view)); err != nil {
					return nil, fmt.Errorf("remove view %s of dead holder %s: %w", view, r.Holder, err)
				}
				os.Remove(s.viewMarker(family, view))
			}
			os.Remove(path)
			continue
		}
		holders++
		for _, f := range r.Files {
			pinned[f] = true
		}
	}
	dir := filepath.Join(s.root, family)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	candidates := map[fileKey]string{}
	for _, e := range ents {
		name := e.Name()
		path := filepath.Join(dir, name)
		if strings.HasPrefix(name, tmpPrefix) {
			removeIfAbandoned(path)
			continue
		}
		if !strings.HasSuffix(name, FileExt) || pinned[name] {
			continue
		}
		var st unix.Stat_t
		if err := unix.Stat(path, &st); err != nil {
			continue
		}
		candidates[fileKey{dev: st.Dev, ino: st.Ino}] = name
	}
	if len(candidates) == 0 {
		return nil, s.dropIfEmptyLocked(ctx, family, holders)
	}
	// A process that maps a file pins it even without a reference (a copy
	// restored by someone who forgot to Ref): removing the file would make
	// that copy undumpable (CRIU cannot dump a mapping of an unlinked file).
	for k := range mappedFiles(candidates) {
		delete(candidates, k)
	}
	var freed []string
	for _, name := range candidates {
		// Sealed: unsealed for the unlink, sealed again if a view still links it.
		if err := removeSealed(filepath.Join(dir, name)); err != nil {
			return freed, err
		}
		log.G(ctx).WithField("family", family).WithField("file", name).Debug("memfile: freed")
		freed = append(freed, name)
		os.Remove(s.chargePath(family, name))
	}
	slices.Sort(freed)
	return freed, s.dropIfEmptyLocked(ctx, family, holders)
}

// dropIfEmptyLocked removes a family that has no files (not even one being
// written), no live holders and no views: its directory and its state
// directory (owner record and lock file included; see lockFamily).
// Markers of views that no longer exist are dropped on the way.
// Preconditions: the family lock is held; holders is its live holder count.
func (s *Store) dropIfEmptyLocked(ctx context.Context, family string, holders int) error {
	if holders > 0 {
		return nil
	}
	views := 0
	vdir := filepath.Join(s.stateDir(family), viewMarkers)
	marks, _ := os.ReadDir(vdir)
	for _, m := range marks {
		if _, err := os.Lstat(s.ViewDir(m.Name())); errors.Is(err, os.ErrNotExist) {
			os.Remove(filepath.Join(vdir, m.Name()))
			continue
		}
		views++
	}
	if views > 0 {
		return nil
	}
	dir := filepath.Join(s.root, family)
	if ents, err := os.ReadDir(dir); len(ents) > 0 || (err != nil && !errors.Is(err, os.ErrNotExist)) {
		return nil
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil // a file arrived (ENOTEMPTY): the family lives on
	}
	// Processes waiting for the lock recreate the (empty) directories at
	// any time (FamilyDir): remove only empty ones, the owner, and the lock
	// file last, so that a waiter relocks (see lockFamily) only once the
	// family is gone. A directory recreated meanwhile simply stays.
	state := s.stateDir(family)
	for _, d := range []string{s.refsDir(family), vdir, s.chargesDir(family)} {
		if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil
		}
	}
	tmps, _ := filepath.Glob(filepath.Join(state, ".*.tmp-*")) // of atomicfile writers that died
	for _, p := range append(tmps, s.ownerPath(family), filepath.Join(state, "lock")) {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove state of empty family %s: %w", family, err)
		}
	}
	os.Remove(state)
	log.G(ctx).WithField("family", family).Debug("memfile: empty family removed")
	return nil
}

// removeIfAbandoned removes a half-written file whose writer is gone (its
// flock is free).
func removeIfAbandoned(path string) {
	f, err := os.Open(path)
	if err != nil {
		return
	}
	defer f.Close()
	if unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil {
		os.Remove(path)
	}
}

type fileKey struct {
	dev uint64
	ino uint64
}

// mappedFiles returns the candidates that some process maps, by scanning
// /proc/*/maps for their device and inode (paths differ between mount
// namespaces; device and inode do not).
func mappedFiles(cands map[fileKey]string) map[fileKey]bool {
	out := map[fileKey]bool{}
	eachMapping(cands, func(k fileKey, _, _ uint64) { out[k] = true })
	return out
}

// eachMapping calls fn for every mapping, by any process, of a candidate:
// the file range [off, off+n) it maps. Processes whose maps root may not
// read are passed over: counting them as mapping everything would free
// nothing on hosts where one always refuses (a VM's init here, pid 1).
func eachMapping(cands map[fileKey]string, fn func(k fileKey, off, n uint64)) {
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		if p.Name()[0] < '0' || p.Name()[0] > '9' {
			continue
		}
		_ = eachMappingOf(p.Name(), cands, fn)
	}
}

// MappedBy reports whether any of pids maps the file at path, by device and
// inode as eachMapping reads them. A file it cannot stat, or a live process
// whose maps it cannot read, counts as mapped: a file kept too long is
// better than one removed under a mapping.
func MappedBy(pids []int, path string) bool {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return true
	}
	k := fileKey{dev: st.Dev, ino: st.Ino}
	mapped := false
	for _, pid := range pids {
		err := eachMappingOf(strconv.Itoa(pid), map[fileKey]string{k: path}, func(fileKey, uint64, uint64) { mapped = true })
		if mapped || err != nil && unix.Kill(pid, 0) == nil {
			return true
		}
	}
	return false
}

// eachMappingOf is eachMapping for one process (its /proc directory name).
func eachMappingOf(proc string, cands map[fileKey]string, fn func(k fileKey, off, n uint64)) error {
	b, err := os.ReadFile("/proc/" + proc + "/maps")
	if err != nil {
		return err
	}
	for _, line := range strings.Split(string(b), "\n") {
		// addr perms offset dev inode path
		f := strings.Fields(line)
		if len(f) < 6 || f[4] == "0" {
			continue
		}
		maj, min, ok := strings.Cut(f[3], ":")
		if !ok {
			continue
		}
		ma, err1 := strconv.ParseUint(maj, 16, 32)
		mi, err2 := strconv.ParseUint(min, 16, 32)
		ino, err3 := strconv.ParseUint(f[4], 10, 64)
		if err1 != nil || err2 != nil || err3 != nil {
			continue
		}
		k := fileKey{dev: unix.Mkdev(uint32(ma), uint32(mi)), ino: ino}
		if _, ok := cands[k]; !ok {
			continue
		}
		lo, hi, _ := strings.Cut(f[0], "-")
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		off, err3 := strconv.ParseUint(f[2], 16, 64)
		if err1 != nil || err2 != nil || err3 != nil || end < start {
			// Unreadable: count the whole file as mapped.
			fn(k, 0, ^uint64(0))
			continue
		}
		fn(k, off, end-start)
	}
	return nil
}

// writeJSONAtomic writes v as JSON to path through a temporary file and a
// rename: a reader sees the old or the new file, never a torn one. No fsync:
// LazyFork's state lives on a tmpfs and does not outlive a reboot.
func writeJSONAtomic(path string, v any, mode os.FileMode) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(path, append(b, '\n'), mode)
}
