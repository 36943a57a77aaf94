//go:build linux

package client

import (
	"archive/tar"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	metadata "github.com/checkpoint-restore/checkpointctl/lib"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/stats"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/pkg/archive"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	cfs "github.com/containerd/continuity/fs"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/criuimg"
	"github.com/lazyfork/lazyfork/memfile"
)

// A checkpoint archive, as containerd's CRI writes it (CheckpointContainer,
// kubelet's checkpoint API) and checkpointctl, Podman and CRI-O read it: a
// tar of config.dump, spec.dump, status, rootfs-diff.tar (the writable
// layer), stats-dump and checkpoint/ (the CRIU image). An export adds
// ExportRecordFile, what LazyFork knows besides; an archive without it
// imports too.
const (
	// ExportRecordFile is LazyFork's own entry of an exported archive.
	ExportRecordFile = "lazyfork-export.json"
	statsDumpFile    = "stats-dump"
)

// ExportRecord is what an export records for LazyFork besides the standard
// entries.
type ExportRecord struct {
	Version   int       `json:"version"`
	Namespace string    `json:"namespace"`
	Container string    `json:"container"`
	Name      string    `json:"name,omitempty"`
	Family    string    `json:"family,omitempty"`
	Taken     time.Time `json:"taken"`
	Exported  time.Time `json:"exported"`
	// Pages is the number of pages written into the CRIU image.
	Pages uint64 `json:"pages"`
}

// ExportResult describes an Export.
type ExportResult struct {
	Archive   string
	Container string
	Snapshot  string // the snapshot's image directory (gone if Export took it)
	Pages     uint64 // pages inlined into the archive's CRIU image
	Bytes     int64  // size of the archive
}

// Export writes a self-contained checkpoint archive of ref to output: ref is
// a container (a running one is snapshotted now and keeps running; a stopped
// one gives the snapshot `lazyfork stop` kept) or a snapshot directory (its
// image directory or the directory holding it). The archive has the layout of
// containerd's CRI checkpoints (checkpointctl's names); its CRIU image is a
// standard one: the memory that LazyFork keeps in memory files is written
// back into pagemap and pages images and the memory mount leaves the mount
// tree, so checkpointctl, a plain `criu restore` or `runc restore`, and CRI's
// restore from an archive read it without LazyFork. Import turns it back into
// a LazyFork snapshot, here or on another host. On error nothing is left at
// output.
func (c *Client) Export(ctx context.Context, ref, output string) (_ *ExportResult, retErr error) {
	if output == "" {
		return nil, fmt.Errorf("export %s: no output file: %w", ref, errdefs.ErrInvalidArgument)
	}
	if err := c.onNode("export"); err != nil {
		return nil, fmt.Errorf("export %s: %w", ref, err)
	}
	output, err := filepath.Abs(output)
	if err != nil {
		return nil, err
	}
	if _, err := os.Lstat(output); err == nil {
		return nil, fmt.Errorf("export %s: %s exists; remove it or choose another file: %w", ref, output, errdefs.ErrAlreadyExists)
	}
	ns, err := namespaces.NamespaceRequired(ctx)
	if err != nil {
		return nil, err
	}
	imageDir, ctr, took, err := c.exportSource(ctx, ref)
	if err != nil {
		return nil, fmt.Errorf("export %s: %w", ref, err)
	}
	if took {
		defer func() {
			if err := c.RemoveSnapshot(context.WithoutCancel(ctx), imageDir); err != nil {
				log.G(ctx).WithError(err).WithField("snapshot", imageDir).Warn("lazyfork: remove the export's snapshot")
			}
		}()
	}
	info, err := ctr.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("export %s: %w", ref, err)
	}
	spec, err := ctr.Spec(ctx)
	if err != nil {
		return nil, fmt.Errorf("export %s: spec: %w", ref, err)
	}
	snap, err := memfile.ReadSnapshot(imageDir)
	if err != nil && !errdefs.IsNotFound(err) {
		return nil, fmt.Errorf("export %s: %w", ref, err)
	}
	famDir := ""
	if snap != nil {
		store, err := memfile.OpenStore(api.Root(c.root).Mem())
		if err != nil {
			return nil, fmt.Errorf("export %s: %w", ref, err)
		}
		if famDir, err = store.FamilyDir(snap.Family); err != nil {
			return nil, fmt.Errorf("export %s: %w", ref, err)
		}
	}

	stage, err := os.MkdirTemp(filepath.Dir(output), ".lazyfork-export-")
	if err != nil {
		return nil, fmt.Errorf("export %s: %w", ref, err)
	}
	defer os.RemoveAll(stage)
	ckpt := filepath.Join(stage, metadata.CheckpointDirectory)
	if err := os.Mkdir(ckpt, 0o700); err != nil {
		return nil, err
	}
	if err := inlineImage(imageDir, ckpt, famDir); err != nil {
		return nil, fmt.Errorf("export %s: snapshot %s: %w", ref, imageDir, err)
	}
	pages, err := imagePages(ckpt)
	if err != nil {
		return nil, fmt.Errorf("export %s: %w", ref, err)
	}

	taken := time.Now().UTC()
	if snap != nil {
		taken = snap.Created
	}
	imgRef := ""
	if img, err := ctr.Image(ctx); err == nil {
		imgRef = img.Target().Digest.String()
	}
	cfg := metadata.ContainerConfig{
		ID:              info.ID,
		Name:            nameOf(info),
		RootfsImage:     info.Image,
		RootfsImageRef:  imgRef,
		RootfsImageName: info.Image,
		OCIRuntime:      info.Runtime.Name,
		CreatedTime:     info.CreatedAt,
		CheckpointedAt:  taken,
	}
	rec := ExportRecord{Version: 1, Namespace: ns, Container: info.ID, Name: nameOf(info), Taken: taken,
		Exported: time.Now().UTC(), Pages: pages}
	if snap != nil {
		rec.Family = snap.Family
	}
	status := metadata.ContainerdStatus{CreatedAt: info.CreatedAt.UnixNano()}
	for name, v := range map[string]any{
		metadata.ConfigDumpFile: cfg,
		metadata.SpecDumpFile:   spec,
		metadata.StatusFile:     status,
		ExportRecordFile:        rec,
	} {
		b, err := json.MarshalIndent(v, "", "  ")
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(filepath.Join(stage, name), b, 0o600); err != nil {
			return nil, err
		}
	}
	if err := writeStatsDump(filepath.Join(stage, statsDumpFile), ckpt, pages); err != nil {
		return nil, fmt.Errorf("export %s: stats-dump: %w", ref, err)
	}
	if err := c.writeRootfsDiff(ctx, filepath.Dir(imageDir), info, filepath.Join(stage, metadata.RootFsDiffTar)); err != nil {
		return nil, fmt.Errorf("export %s: %s: %w", ref, metadata.RootFsDiffTar, err)
	}

	tmp := filepath.Join(filepath.Dir(output), "."+filepath.Base(output)+".tmp")
	n, err := tarDir(stage, tmp)
	if err == nil {
		err = os.Rename(tmp, output)
	}
	if err != nil {
		_ = os.Remove(tmp)
		if errors.Is(err, unix.ENOSPC) {
			err = fmt.Errorf("%w: %w", err, errdefs.ErrResourceExhausted)
		}
		return nil, fmt.Errorf("export %s to %s: %w", ref, output, err)
	}
	res := &ExportResult{Archive: output, Container: info.ID, Snapshot: imageDir, Pages: pages, Bytes: n}
	if took {
		res.Snapshot = ""
	}
	return res, nil
}

// exportSource finds the snapshot to export and the container it was taken
// of. took: the snapshot was taken for this export (and goes after it).
func (c *Client) exportSource(ctx context.Context, ref string) (imageDir string, ctr containerd.Container, took bool, err error) {
	if st, serr := os.Stat(ref); serr == nil && st.IsDir() && strings.Contains(ref, "/") {
		imageDir, err = filepath.Abs(ref)
		if err != nil {
			return "", nil, false, err
		}
		if _, err := os.Stat(filepath.Join(imageDir, "inventory.img")); err != nil {
			imageDir = api.ImageDir(imageDir)
		}
		if _, err := os.Stat(filepath.Join(imageDir, "inventory.img")); err != nil {
			return "", nil, false, fmt.Errorf("%s holds no CRIU image (no inventory.img): %w", ref, errdefs.ErrInvalidArgument)
		}
		src, err := api.ReadSnapshotSource(imageDir)
		if err != nil {
			return "", nil, false, fmt.Errorf("snapshot %s: %w", imageDir, err)
		}
		if ns, _ := namespaces.Namespace(ctx); src.Namespace != "" && src.Namespace != ns {
			return "", nil, false, fmt.Errorf("snapshot %s was taken in containerd namespace %q, not %q (pass --namespace %s): %w",
				imageDir, src.Namespace, ns, src.Namespace, errdefs.ErrFailedPrecondition)
		}
		ctr, err = c.cd.LoadContainer(ctx, src.Container)
		if err != nil {
			return "", nil, false, fmt.Errorf("snapshot %s: the container it was taken of, %s, is gone, and an export needs its spec and image: %w",
				imageDir, src.Container, err)
		}
		return imageDir, ctr, false, nil
	}
	id, err := c.Resolve(ctx, ref)
	if err != nil {
		return "", nil, false, err
	}
	ctr, err = c.cd.LoadContainer(ctx, id)
	if err != nil {
		return "", nil, false, err
	}
	labels, err := ctr.Labels(ctx)
	if err != nil {
		return "", nil, false, err
	}
	snap, err := c.stoppedSnapshot(ctx, id, labels)
	if err != nil {
		return "", nil, false, err
	}
	if snap != "" {
		return snap, ctr, false, nil
	}
	res, err := c.Checkpoint(ctx, id)
	if err != nil {
		return "", nil, false, err
	}
	return res.Snapshot, ctr, true, nil
}

// nameOf is a container's LazyFork or nerdctl name, else its id.
func nameOf(info containers.Container) string {
	for _, l := range []string{api.LabelName, LabelNerdctlName} {
		if v := info.Labels[l]; v != "" {
			return v
		}
	}
	return info.ID
}

// imagePages counts the pages in an image's pagemaps.
func imagePages(dir string) (uint64, error) {
	pms, _ := filepath.Glob(filepath.Join(dir, "pagemap-*.img"))
	var n uint64
	for _, p := range pms {
		img, err := criuimg.ReadImage(p, criuimg.MagicPagemap, criuimg.KindOf(p).NewEntry)
		if err != nil {
			return 0, err
		}
		for _, e := range img.Entries[1:] {
			pe := e.(interface{ GetNrPages() uint32 })
			n += uint64(pe.GetNrPages())
		}
	}
	return n, nil
}

// writeStatsDump writes CRIU's dump statistics (what `checkpointctl inspect
// --stats` and `crit show stats-dump` read): the image's own, if CRIU left
// one in it, else one recording the pages the export wrote (a LazyFork
// snapshot's timings are its shim's log's, not CRIU's).
func writeStatsDump(path, ckpt string, pages uint64) error {
	if _, err := os.Stat(filepath.Join(ckpt, statsDumpFile)); err == nil {
		return copyFile(filepath.Join(ckpt, statsDumpFile), path)
	}
	img := &criuimg.Image{Head: criuimg.MagicService, Magic: criuimg.MagicStats, Entries: []proto.Message{
		&stats.StatsEntry{Dump: &stats.DumpStatsEntry{
			FreezingTime: proto.Uint32(0), FrozenTime: proto.Uint32(0),
			MemdumpTime: proto.Uint32(0), MemwriteTime: proto.Uint32(0),
			PagesScanned: proto.Uint64(pages), PagesSkippedParent: proto.Uint64(0),
			PagesWritten: proto.Uint64(pages), PagesLazy: proto.Uint64(0),
		}},
	}}
	return criuimg.WriteImage(path, img)
}

// onNode checks that the client works on LazyFork's files in this process
// (WithRoot): export and import read and write snapshot images and memory
// files, which the node API does not carry.
func (c *Client) onNode(op string) error {
	if c.root == "" {
		return fmt.Errorf("%s reads and writes LazyFork's snapshot images and memory files, which the node API does not carry: run it on the node as root (lazyfork --root, or client.WithRoot): %w", op, errdefs.ErrNotImplemented)
	}
	return nil
}

// writeRootfsDiff writes the writable layer the snapshot recorded (its copy
// of the upper directory, or its frozen layer merged with the frozen layers
// it stacks on) as an OCI layer tar, overlay whiteouts as .wh. entries. A snapshot without a record (taken by ctr or
// CRI) gives the container's current writable layer.
func (c *Client) writeRootfsDiff(ctx context.Context, snapDir string, info containers.Container, path string) error {
	rfs := &api.RootfsRecord{}
	if snap, err := c.node.Snapshot(ctx, api.ImageDir(snapDir)); err == nil && snap.Rootfs != nil {
		rfs = snap.Rootfs
	}
	layers, release, err := c.recordedLayers(ctx, rfs)
	if err != nil {
		return err
	}
	defer release()
	layer := ""
	switch len(layers) {
	case 0:
	case 1:
		layer = layers[0]
	default:
		// Frozen layers on frozen layers (a fork of a fork): one layer, as
		// the fork saw them.
		merged, err := os.MkdirTemp(filepath.Dir(path), ".layer-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(merged)
		for _, l := range layers {
			if err := mergeLayer(merged, l); err != nil {
				return err
			}
		}
		layer = merged
	}
	if layer == "" && info.SnapshotKey != "" {
		if layer, err = c.upperDir(ctx, info.Snapshotter, info.SnapshotKey); err != nil {
			return err
		}
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	cw := archive.NewChangeWriter(f, layer)
	if layer != "" {
		err = overlayChanges(layer, cw.HandleChange)
	}
	if cerr := cw.Close(); err == nil {
		err = cerr
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// overlayChanges reports an overlay upper directory as layer changes:
// whiteouts (0/0 character devices) as deletions, opaque directories as
// the directory and the deletion of its lower contents.
func overlayChanges(upper string, fn cfs.ChangeFunc) error {
	return filepath.Walk(upper, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(upper, p)
		if err != nil || rel == "." {
			return err
		}
		name := "/" + rel
		if fi.Mode()&os.ModeCharDevice != 0 {
			// filepath.Walk's Lstat gives syscall's Stat_t (not unix's).
			if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Rdev == 0 {
				return fn(cfs.ChangeKindDelete, name, nil, nil)
			}
		}
		if err := fn(cfs.ChangeKindAdd, name, fi, nil); err != nil {
			return err
		}
		if fi.IsDir() {
			for _, x := range []string{"trusted.overlay.opaque", "user.overlay.opaque"} {
				buf := make([]byte, 4)
				if n, err := unix.Lgetxattr(p, x, buf); err == nil && n == 1 && buf[0] == 'y' {
					return fn(cfs.ChangeKindDelete, filepath.Join(name, ".wh..wh..opq"), nil, nil)
				}
			}
		}
		return nil
	})
}

// tarDir writes the regular files and directories under dir into a new tar
// file at path, sorted, and returns its size.
func tarDir(dir, path string) (int64, error) {
	var names []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p != dir {
			names = append(names, p)
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	sort.Strings(names)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	for _, p := range names {
		fi, err := os.Lstat(p)
		if err != nil {
			return 0, err
		}
		rel, _ := filepath.Rel(dir, p)
		h := &tar.Header{Name: rel, ModTime: fi.ModTime(), Format: tar.FormatPAX}
		switch {
		case fi.IsDir():
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, rel+"/", 0o700
		case fi.Mode().IsRegular():
			h.Typeflag, h.Size, h.Mode = tar.TypeReg, fi.Size(), 0o600
		default:
			continue
		}
		if err := tw.WriteHeader(h); err != nil {
			return 0, err
		}
		if h.Typeflag == tar.TypeReg {
			in, err := os.Open(p)
			if err != nil {
				return 0, err
			}
			_, err = io.Copy(tw, in)
			in.Close()
			if err != nil {
				return 0, err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return 0, err
	}
	if err := f.Sync(); err != nil {
		return 0, err
	}
	st, err := f.Stat()
	if err != nil {
		return 0, err
	}
	return st.Size(), f.Close()
}
