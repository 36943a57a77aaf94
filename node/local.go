//go:build linux

package node

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/atomicfile"
	"github.com/lazyfork/lazyfork/internal/procfs"
	"github.com/lazyfork/lazyfork/memfile"
)

// OpMarker is a file in a snapshot directory naming the operation that made
// it, while that operation runs; a kept snapshot loses it when its operation
// succeeds. A directory holding it whose operation is over is an orphan.
const OpMarker = "op"

// Local is a Node on the files of a root on this host.
type Local struct {
	root api.Root
}

// NewLocal is the Node of root's files.
func NewLocal(root string) *Local { return &Local{root: api.Root(root)} }

// Root is the root directory.
func (l *Local) Root() string { return string(l.root) }

// Close does nothing.
func (l *Local) Close() error { return nil }

var _ Node = (*Local)(nil)

func checkID(id string) error {
	if !api.ValidName(id) {
		return fmt.Errorf("operation id %q: letters, digits, '_', '.', '-' only: %w", id, errdefs.ErrInvalidArgument)
	}
	return nil
}

// snapDir checks that dir is a directory of ROOT/snapshots.
func (l *Local) snapDir(dir string) (string, error) {
	dir = filepath.Clean(dir)
	if filepath.Dir(dir) != l.root.Snapshots() || dir == l.root.Snapshots() {
		return "", fmt.Errorf("%s is not a snapshot directory of %s: %w", dir, l.root.Snapshots(), errdefs.ErrInvalidArgument)
	}
	return dir, nil
}

// PrepareSnapshot makes ROOT/snapshots/<op>/ with op's marker and image/.
func (l *Local) PrepareSnapshot(_ context.Context, op string) (string, string, error) {
	if err := checkID(op); err != nil {
		return "", "", err
	}
	if err := os.MkdirAll(l.root.Snapshots(), 0o700); err != nil {
		return "", "", err
	}
	dir := filepath.Join(l.root.Snapshots(), op)
	if err := os.Mkdir(dir, 0o700); err != nil {
		if errors.Is(err, os.ErrExist) {
			return "", "", fmt.Errorf("snapshot directory %s: %w", dir, errdefs.ErrAlreadyExists)
		}
		return "", "", err
	}
	if err := os.WriteFile(filepath.Join(dir, OpMarker), []byte(op+"\n"), 0o600); err != nil {
		return "", "", err
	}
	image := api.ImageDir(dir)
	if err := os.Mkdir(image, 0o700); err != nil {
		return "", "", err
	}
	return dir, image, nil
}

// KeepSnapshot removes the snapshot's operation marker.
func (l *Local) KeepSnapshot(_ context.Context, dir string) error {
	dir, err := l.snapDir(dir)
	if err != nil {
		return err
	}
	if err := os.Remove(filepath.Join(dir, OpMarker)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// RemoveSnapshot drops the snapshot's reference on its family's memory files
// (if it got one) and removes its directory; a missing one is not an error.
func (l *Local) RemoveSnapshot(_ context.Context, dir string) error {
	dir, err := l.snapDir(dir)
	if err != nil {
		return err
	}
	var errs []error
	image := api.ImageDir(dir)
	if info, err := memfile.ReadSnapshot(image); err == nil && info.Family != "" {
		store, err := memfile.OpenStore(l.root.Mem())
		if err != nil {
			errs = append(errs, err)
		} else if err := store.Unref(info.Family, memfile.HolderSnapshot+image); err != nil && !errdefs.IsNotFound(err) {
			errs = append(errs, fmt.Errorf("unref snapshot: %w", err))
		}
	} else if err != nil && !errdefs.IsNotFound(err) && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("read snapshot %s: %w", image, err))
	}
	if err := os.RemoveAll(dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// SetRootfs writes snapDir/api.RootfsFile.
func (l *Local) SetRootfs(_ context.Context, dir string, r *api.RootfsRecord) error {
	dir, err := l.snapDir(dir)
	if err != nil {
		return err
	}
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(filepath.Join(dir, api.RootfsFile), b, 0o600)
}

// ReleaseRootfs removes the snapshot's layer copy and rootfs record.
func (l *Local) ReleaseRootfs(_ context.Context, dir string) error {
	dir, err := l.snapDir(dir)
	if err != nil {
		return err
	}
	err = os.Remove(filepath.Join(dir, api.RootfsFile))
	if errors.Is(err, os.ErrNotExist) {
		err = nil
	}
	return errors.Join(os.RemoveAll(filepath.Join(dir, "upper")), err)
}

// readRootfs reads snapDir/api.RootfsFile.
func readRootfs(snapDir string) (*api.RootfsRecord, error) {
	b, err := os.ReadFile(filepath.Join(snapDir, api.RootfsFile))
	if err != nil {
		return nil, fmt.Errorf("rootfs of the snapshot: %w", errdefs.ErrNotFound)
	}
	var r api.RootfsRecord
	if err := json.Unmarshal(b, &r); err != nil || r.Frozen == "" && r.UpperCopy == "" {
		return nil, fmt.Errorf("rootfs of the snapshot: %w", errdefs.ErrDataLoss)
	}
	return &r, nil
}

// Snapshot reads the snapshot at imageDir.
func (l *Local) Snapshot(_ context.Context, imageDir string) (*Snapshot, error) {
	imageDir = filepath.Clean(imageDir)
	info, err := memfile.ReadSnapshot(imageDir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) && !errdefs.IsNotFound(err) {
			err = fmt.Errorf("%w: %w", err, errdefs.ErrNotFound)
		}
		return nil, err
	}
	s := &Snapshot{ImageDir: imageDir, Family: info.Family, Pages: info.Pages}
	if src, err := api.ReadSnapshotSource(imageDir); err == nil {
		s.Thawed, s.Paused = src.Thawed, src.Paused
		s.SourceNamespace, s.SourceContainer = src.Namespace, src.Container
	}
	snapDir := filepath.Dir(imageDir)
	if r, err := readRootfs(snapDir); err == nil {
		s.Rootfs = r
	}
	_ = filepath.WalkDir(imageDir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				s.Bytes += fi.Size()
			}
		}
		return nil
	})
	return s, nil
}

// SnapshotDirs lists ROOT/snapshots.
func (l *Local) SnapshotDirs(context.Context) ([]SnapshotDir, error) {
	ents, err := os.ReadDir(l.root.Snapshots())
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []SnapshotDir
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		dir := filepath.Join(l.root.Snapshots(), e.Name())
		st, err := os.Stat(dir)
		if err != nil {
			continue
		}
		d := SnapshotDir{Dir: dir, ModTime: st.ModTime()}
		if b, err := os.ReadFile(filepath.Join(dir, OpMarker)); err == nil {
			d.Op = strings.TrimSpace(string(b))
		}
		if r, err := readRootfs(dir); err == nil {
			d.Rootfs = r
		}
		out = append(out, d)
	}
	return out, nil
}

// CollectMemory runs the memory store's GC.
func (l *Local) CollectMemory(ctx context.Context) ([]string, error) {
	if _, err := os.Stat(l.root.Mem()); errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	store, err := memfile.OpenStore(l.root.Mem())
	if err != nil {
		return nil, err
	}
	return store.GC(ctx)
}

// Families reports every family in the memory store, by name.
func (l *Local) Families(context.Context) ([]Family, error) {
	memRoot := l.root.Mem()
	ents, err := os.ReadDir(memRoot)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	store, err := memfile.OpenStore(memRoot)
	if err != nil {
		return nil, err
	}
	var out []Family
	for _, e := range ents {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		fi := Family{Name: e.Name(), Files: map[string]int64{}}
		files, _ := os.ReadDir(filepath.Join(memRoot, e.Name()))
		for _, f := range files {
			if !strings.HasSuffix(f.Name(), memfile.FileExt) || strings.HasPrefix(f.Name(), ".") {
				continue
			}
			var st unix.Stat_t
			if unix.Stat(filepath.Join(memRoot, e.Name(), f.Name()), &st) == nil {
				fi.Files[f.Name()] = st.Blocks * 512
				fi.Bytes += st.Blocks * 512
			}
		}
		if h, err := store.Holders(e.Name()); err == nil {
			fi.Holders = h
		}
		if ch, err := store.Charges(e.Name()); err == nil {
			fi.ChargedTo = map[string]string{}
			for f, cg := range ch {
				if _, ok := fi.Files[f]; ok {
					fi.ChargedTo[f] = cg
				}
			}
		}
		if b, err := os.ReadFile(l.root.FamilyRecord(e.Name())); err == nil {
			var rec api.FamilyRecord
			if json.Unmarshal(b, &rec) == nil {
				fi.MemoryCgroup = rec.MemoryCgroup
			}
		}
		out = append(out, fi)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// FreeSpace is the space left on the root's filesystem and the host's
// available memory.
func (l *Local) FreeSpace(context.Context) (Space, error) {
	sp := Space{Root: string(l.root)}
	sp.MemAvailable, _ = memAvailable()
	if err := os.MkdirAll(string(l.root), 0o700); err != nil {
		return sp, err
	}
	var st unix.Statfs_t
	if err := unix.Statfs(string(l.root), &st); err != nil {
		return sp, err
	}
	sp.Free = st.Bavail * uint64(st.Bsize)
	return sp, nil
}

// memAvailable is MemAvailable of /proc/meminfo, in bytes.
func memAvailable() (uint64, error) {
	v, err := procfs.MemInfo("MemAvailable")
	return uint64(v), err
}

func (l *Local) opPath(id string) string { return filepath.Join(l.root.Ops(), id+".json") }

// SaveOp writes ROOT/ops/<id>.json atomically.
func (l *Local) SaveOp(_ context.Context, rec *api.OpRecord) error {
	if err := checkID(rec.ID); err != nil {
		return err
	}
	if err := os.MkdirAll(l.root.Ops(), 0o700); err != nil {
		return fmt.Errorf("operation record: %w", err)
	}
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFile(l.opPath(rec.ID), b, 0o600); err != nil {
		return fmt.Errorf("operation record %s: %w", rec.ID, err)
	}
	return nil
}

// RemoveOp removes an operation's record (a missing one is fine).
func (l *Local) RemoveOp(_ context.Context, id string) error {
	if err := checkID(id); err != nil {
		return err
	}
	if err := os.Remove(l.opPath(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

func readOp(path string) (*api.OpRecord, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var r api.OpRecord
	if err := json.Unmarshal(b, &r); err != nil || r.ID == "" {
		return nil, fmt.Errorf("operation record %s: %w", path, errdefs.ErrDataLoss)
	}
	return &r, nil
}

// Ops lists the records of ROOT/ops and whether their operation is alive.
func (l *Local) Ops(context.Context) ([]OpState, error) {
	ents, err := os.ReadDir(l.root.Ops())
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []OpState
	var errs []error
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".json") || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		rec, err := readOp(filepath.Join(l.root.Ops(), e.Name()))
		if err != nil {
			if !errors.Is(err, os.ErrNotExist) {
				// A torn record cannot exist (written atomically): not ours.
				errs = append(errs, err)
			}
			continue
		}
		out = append(out, OpState{Record: *rec, Alive: l.opAlive(rec)})
	}
	return out, errors.Join(errs...)
}

// opAlive: the operation holds its lock, or (a record of an older client)
// the process that wrote it still runs.
func (l *Local) opAlive(r *api.OpRecord) bool {
	if r.PID > 0 && r.PIDStart != "" && processStart(r.PID) == r.PIDStart {
		return true
	}
	p, err := l.lockPath(OpLock(r.ID))
	return err == nil && lockHeld(p)
}

// processStart is the start time of process pid (clock ticks after boot) as
// text, "" if there is no such process.
func processStart(pid int) string {
	st, err := procfs.ReadStat(pid)
	if err != nil {
		return ""
	}
	return strconv.FormatUint(st.StartTime, 10)
}

// lockPath is the file of lock key: ROOT/locks/<sha256 of ns/id>.lock for a
// parent, ROOT/locks/op-<id>.lock for an operation.
func (l *Local) lockPath(key string) (string, error) {
	if v, ok := strings.CutPrefix(key, "parent:"); ok && strings.Contains(v, "/") {
		sum := sha256.Sum256([]byte(v))
		return filepath.Join(l.root.Locks(), hex.EncodeToString(sum[:16])+".lock"), nil
	}
	if id, ok := strings.CutPrefix(key, "op:"); ok && checkID(id) == nil {
		return filepath.Join(l.root.Locks(), "op-"+id+".lock"), nil
	}
	return "", fmt.Errorf("lock %q: want parent:NS/ID or op:ID: %w", key, errdefs.ErrInvalidArgument)
}

// Lock takes lock key: an flock on its file, released by unlock or by the
// process's death. An operation's lock file goes with its unlock.
func (l *Local) Lock(ctx context.Context, key string, wait bool) (func(), bool, error) {
	p, err := l.lockPath(key)
	if err != nil {
		return nil, false, err
	}
	if err := os.MkdirAll(l.root.Locks(), 0o700); err != nil {
		return nil, false, fmt.Errorf("lock %s: %w", key, err)
	}
	for {
		f, ok, err := tryLockFile(p)
		if err != nil {
			return nil, false, fmt.Errorf("lock %s: %w", key, err)
		}
		if ok {
			op := strings.HasPrefix(key, "op:")
			return func() {
				if op {
					os.Remove(p)
				}
				f.Close()
			}, true, nil
		}
		if !wait {
			return nil, false, nil
		}
		select {
		case <-ctx.Done():
			return nil, false, fmt.Errorf("wait for lock %s: %w", key, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// RemoveLock removes lock key's file unless it is held.
func (l *Local) RemoveLock(_ context.Context, key string) (bool, error) {
	p, err := l.lockPath(key)
	if err != nil {
		return false, err
	}
	return removeLockFile(p), nil
}

// SweepLocks removes the lock files not named by keep that nobody holds.
func (l *Local) SweepLocks(_ context.Context, keep []string, dry bool) ([]string, error) {
	kept := map[string]bool{}
	for _, k := range keep {
		p, err := l.lockPath(k)
		if err != nil {
			return nil, err
		}
		kept[p] = true
	}
	files, _ := filepath.Glob(filepath.Join(l.root.Locks(), "*.lock"))
	var removed []string
	for _, p := range files {
		if kept[p] {
			continue
		}
		if dry && !lockHeld(p) || !dry && removeLockFile(p) {
			removed = append(removed, filepath.Base(p))
		}
	}
	return removed, nil
}

// tryLockFile takes an exclusive flock on the file at p (created if
// missing) without waiting. The lock holds only if p still names the locked
// file once it is taken: a remover (removeLockFile) unlinks p under the lock,
// and whoever had opened the unlinked file retries on the new one.
func tryLockFile(p string) (_ *os.File, ok bool, _ error) {
	for {
		f, err := os.OpenFile(p, os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, false, err
		}
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			f.Close()
			if errors.Is(err, unix.EWOULDBLOCK) || errors.Is(err, unix.EINTR) {
				return nil, false, nil
			}
			return nil, false, err
		}
		var held, named unix.Stat_t
		if unix.Fstat(int(f.Fd()), &held) == nil && unix.Stat(p, &named) == nil && held.Ino == named.Ino && held.Dev == named.Dev {
			return f, true, nil
		}
		f.Close() // removed meanwhile: lock the file that p names now
	}
}

// lockHeld tells whether a process holds the lock file p (a missing file
// is not held). It creates nothing.
func lockHeld(p string) bool {
	f, err := os.OpenFile(p, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	return errors.Is(err, unix.EWOULDBLOCK)
}

// removeLockFile unlinks the lock file p if no process holds it: a deleted
// container's lock goes with it, so ROOT/locks does not grow with every
// container ever forked. It reports whether p is gone.
func removeLockFile(p string) bool {
	if _, err := os.Lstat(p); errors.Is(err, os.ErrNotExist) {
		return true
	}
	f, ok, err := tryLockFile(p)
	if err != nil || !ok {
		return errors.Is(err, os.ErrNotExist)
	}
	defer f.Close()
	return os.Remove(p) == nil
}

// SaveRestoreLog copies fork id's CRIU restore log out of its task bundle
// (which its removal deletes) into ROOT/logs and returns the copy's path, ""
// if it is not found. The bundle is found beside the bundle a LazyFork shim
// of the namespace runs in (its working directory).
func (l *Local) SaveRestoreLog(ctx context.Context, ns, id string) (string, error) {
	if strings.ContainsAny(ns+id, "/\x00") || ns == "" || id == "" || ns == ".." || id == ".." {
		return "", fmt.Errorf("restore log of %s/%s: %w", ns, id, errdefs.ErrInvalidArgument)
	}
	for _, p := range procfs.Find(func(args []string) bool {
		return strings.HasPrefix(filepath.Base(args[0]), "containerd-shim-lazyfork")
	}) {
		cwd, err := os.Readlink("/proc/" + strconv.Itoa(p.PID) + "/cwd")
		if err != nil || filepath.Base(filepath.Dir(cwd)) != ns {
			continue
		}
		src := filepath.Join(filepath.Dir(cwd), id, "work", "restore.log")
		in, err := os.Open(src)
		if err != nil {
			continue
		}
		defer in.Close()
		dst := filepath.Join(l.root.Logs(), ns+"-"+id+"-restore.log")
		if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
			return src, nil
		}
		out, err := os.Create(dst)
		if err != nil {
			return src, nil
		}
		defer out.Close()
		if _, err := io.Copy(out, in); err != nil {
			log.G(ctx).WithError(err).Warn("lazyfork: copy restore log")
			return src, nil
		}
		return dst, nil
	}
	return "", nil
}
