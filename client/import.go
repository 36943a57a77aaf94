//go:build linux

package client

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	metadata "github.com/checkpoint-restore/checkpointctl/lib"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/defaults"
	"github.com/containerd/containerd/v2/pkg/archive"
	"github.com/containerd/containerd/v2/pkg/archive/compression"
	"github.com/containerd/containerd/v2/pkg/identifiers"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/internal/ckptarchive"
	"github.com/lazyfork/lazyfork/memfile"
	"github.com/lazyfork/lazyfork/memfile/madvguard"
)

// ImportOpt configures Import.
type ImportOpt func(*importConfig)

type importConfig struct {
	name         string
	snapshotter  string
	cgroupParent string
	runtimeOpts  any
	labels       map[string]string
}

// WithImportName names the imported container (default: the name the
// archive records).
func WithImportName(name string) ImportOpt { return func(c *importConfig) { c.name = name } }

// WithImportSnapshotter prepares the container's rootfs on this snapshotter
// (default: containerd's default).
func WithImportSnapshotter(sn string) ImportOpt {
	return func(c *importConfig) { c.snapshotter = sn }
}

// WithImportCgroupParent puts the container's cgroup (and its forks') under
// this cgroup (default: where the archive's container had its own).
func WithImportCgroupParent(p string) ImportOpt {
	return func(c *importConfig) { c.cgroupParent = p }
}

// WithImportRuntimeOptions gives the container's runtime these options
// (runc's, e.g. its root).
func WithImportRuntimeOptions(o any) ImportOpt { return func(c *importConfig) { c.runtimeOpts = o } }

// WithImportLabels adds labels to the imported container.
func WithImportLabels(l map[string]string) ImportOpt { return func(c *importConfig) { c.labels = l } }

// ImportResult describes an Import.
type ImportResult struct {
	Container string // the new (stopped) container: fork it
	Family    string
	Snapshot  string // its snapshot's image directory
	Pages     uint64 // pages moved into memory files
}

// Limits on an archive's entries: metadata files are small.
const (
	maxMetadataFile  = 16 << 20
	importTmpfsSpare = 64 << 20
)

// Import turns a checkpoint archive (one Export wrote, or one containerd's
// CRI or the kubelet wrote of a container) into a LazyFork snapshot under
// this client's root, its memory rewritten into memory files of a new family
// as a fresh dump's is, and a stopped container in the context's namespace
// that holds it (as `lazyfork stop` leaves one): Fork makes running copies
// of it at once. The archive's image must be in this containerd already.
// The archive is untrusted input. On error nothing is left: no snapshot,
// memory file, family or container.
func (c *Client) Import(ctx context.Context, archivePath string, opts ...ImportOpt) (_ *ImportResult, retErr error) {
	var cfg importConfig
	for _, o := range opts {
		o(&cfg)
	}
	ns, err := namespaces.NamespaceRequired(ctx)
	if err != nil {
		return nil, err
	}
	fail := func(err error) error { return fmt.Errorf("import %s: %w", archivePath, err) }
	if err := c.onNode("import"); err != nil {
		return nil, fail(err)
	}

	// The metadata first: a wrong file fails before anything is made.
	meta, err := readArchiveMetadata(archivePath)
	if err != nil {
		return nil, fail(err)
	}
	name := cfg.name
	if name == "" {
		name = meta.config.Name
	}
	if name == "" {
		name = meta.config.ID
	}
	if err := identifiers.Validate(name); err != nil {
		return nil, fail(fmt.Errorf("container name %q (choose one with --name): %w", name, err))
	}
	if !api.ValidName(name) {
		return nil, fail(fmt.Errorf("container name %q: want letters, digits, '_', '.', '-' (it names the snapshot's family too; choose one with --name): %w", name, errdefs.ErrInvalidArgument))
	}
	if _, err := c.cd.LoadContainer(ctx, name); err == nil {
		return nil, fail(fmt.Errorf("a container %s exists already in namespace %s; choose another name (--name): %w", name, ns, errdefs.ErrAlreadyExists))
	}
	if id, err := c.Resolve(ctx, name); err == nil && id != name {
		return nil, fail(fmt.Errorf("container %s is named %s already; choose another name (--name): %w", id, name, errdefs.ErrAlreadyExists))
	}
	imgName := meta.config.RootfsImageName
	if imgName == "" {
		imgName = meta.config.RootfsImage
	}
	if imgName == "" {
		return nil, fail(fmt.Errorf("%s names no image: %w", metadata.ConfigDumpFile, errdefs.ErrInvalidArgument))
	}
	img, err := c.cd.GetImage(ctx, imgName)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return nil, fail(fmt.Errorf("the archive's container runs image %s, which is not in namespace %s: pull it first (lazyfork pull %s): %w", imgName, ns, imgName, errdefs.ErrNotFound))
		}
		return nil, fail(err)
	}
	sn := cfg.snapshotter
	if sn == "" {
		if sn, err = c.cd.GetLabel(ctx, defaults.DefaultSnapshotterNSLabel); err != nil {
			return nil, fail(err)
		}
		if sn == "" {
			sn = defaults.DefaultSnapshotter
		}
	}
	if ok, err := img.IsUnpacked(ctx, sn); err != nil || !ok {
		if err := img.Unpack(ctx, sn); err != nil {
			return nil, fail(fmt.Errorf("unpack image %s on %s: %w", imgName, sn, err))
		}
	}

	// The snapshot lives on LazyFork's tmpfs, beside its memory files.
	if err := memfile.EnsureTmpfs(c.root, tmpfsSizeFromEnv()); err != nil {
		return nil, fail(err)
	}
	store, err := memfile.OpenStore(api.Root(c.root).Mem())
	if err != nil {
		return nil, fail(err)
	}
	snapshots := api.Root(c.root).Snapshots()
	if err := os.MkdirAll(snapshots, 0o700); err != nil {
		return nil, fail(err)
	}
	snapDir, err := os.MkdirTemp(snapshots, "import-")
	if err != nil {
		return nil, fail(err)
	}
	family := ""
	rewritten := false
	defer func() {
		if retErr == nil {
			return
		}
		if rewritten {
			if err := c.node.RemoveSnapshot(context.WithoutCancel(ctx), snapDir); err != nil {
				log.G(ctx).WithError(err).WithField("snapshot", snapDir).Warn("lazyfork: remove the failed import's snapshot")
			}
		} else if err := memfile.RemoveAll(snapDir); err != nil {
			log.G(ctx).WithError(err).WithField("snapshot", snapDir).Warn("lazyfork: remove the failed import's snapshot")
		}
		if family != "" {
			_, _ = store.GC(context.WithoutCancel(ctx))
		}
	}()
	imageDir := api.ImageDir(snapDir)
	raw := filepath.Join(snapDir, "archive-image")
	upper := filepath.Join(snapDir, "upper")
	for _, d := range []string{raw, upper} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return nil, fail(err)
		}
	}
	if err := unpackArchive(ctx, archivePath, raw, upper); err != nil {
		return nil, fail(err)
	}
	// A CRI archive of a LazyFork container holds a rewritten image: its
	// memory is in files of the host (and root) that took it.
	if err := os.Mkdir(imageDir, 0o700); err != nil {
		return nil, fail(err)
	}
	famDir := ""
	if snap, err := memfile.ReadSnapshot(raw); err == nil {
		// Its files, if this host (and root) took it; looked up, not made.
		if !api.ValidName(snap.Family) {
			return nil, fail(fmt.Errorf("the archive's LazyFork snapshot names a bad family %q: %w", snap.Family, errdefs.ErrInvalidArgument))
		}
		famDir = filepath.Join(api.Root(c.root).Mem(), snap.Family)
	}
	if err := inlineImage(raw, imageDir, famDir); err != nil {
		if errdefs.IsNotFound(err) {
			err = fmt.Errorf("%w; this archive holds a LazyFork snapshot, not a standard CRIU image: make it with `lazyfork export` where it was taken", err)
		}
		return nil, fail(err)
	}
	if err := memfile.RemoveAll(raw); err != nil {
		return nil, fail(err)
	}
	if err := dropNrPages64(imageDir); err != nil {
		return nil, fail(err)
	}
	if err := addMemMount(imageDir); err != nil {
		return nil, fail(err)
	}

	// Held while the rewrite runs, by a reference tied to the image
	// directory (as a task's to its bundle: dead once it is gone, whatever
	// PID namespace this process runs in): a GC meanwhile would find the
	// claimed family empty and drop its owner. The snapshot holds it once
	// the rewrite committed.
	claim := "import:" + imageDir
	family, err = claimFamily(store, ns, name, claim, imageDir)
	if err != nil {
		return nil, fail(err)
	}
	defer store.Unref(family, claim)
	famDir, err = store.FamilyDir(family)
	if err != nil {
		return nil, fail(err)
	}
	src := &api.SnapshotSource{Namespace: ns, Container: name, Family: family, Taken: time.Now().UTC()}
	if meta.spec.Annotations != nil {
		// A pod's container (the spec CRI made): its pod's Kubernetes
		// namespace and opt-in, as the shim records them at a checkpoint,
		// so pods of that namespace may fork the import (lazyfork.io/fork-of
		// naming its snapshot directory) as they may fork the original.
		src.PodNamespace = meta.spec.Annotations[annotationSandboxNamespace]
		src.Forkable = meta.spec.Annotations[api.AnnotationForkable] == "true"
	}
	res, err := store.Rewrite(ctx, imageDir, memfile.RewriteOptions{
		Family: family,
		MapDir: memfile.MountPath,
		Stage: func(_ context.Context, staging string) error {
			b, err := json.Marshal(src)
			if err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(staging, api.SourceFile), b, 0o600); err != nil {
				return err
			}
			rs, err := madvguard.DataRanges(staging, memfile.MountPath, famDir)
			if err != nil {
				return fmt.Errorf("madvise guard ranges: %w", err)
			}
			return madvguard.ApplyMode(staging, rs, madvguard.Refuse)
		},
	})
	if err != nil {
		if errors.Is(err, unix.ENOSPC) {
			err = fmt.Errorf("%w: LazyFork's tmpfs at %s is full: %w", err, c.root, errdefs.ErrResourceExhausted)
		}
		return nil, fail(fmt.Errorf("rewrite into memory files of family %s: %w", family, err))
	}
	rewritten = true
	if err := c.node.SetRootfs(ctx, snapDir, &api.RootfsRecord{UpperCopy: upper, Snapshotter: sn, Namespace: ns}); err != nil {
		return nil, fail(err)
	}

	spec := meta.spec
	if spec.Linux == nil {
		spec.Linux = &specs.Linux{}
	}
	switch {
	case cfg.cgroupParent != "":
		spec.Linux.CgroupsPath = filepath.Join(cfg.cgroupParent, name)
	default:
		spec.Linux.CgroupsPath = forkCgroupsPath(spec.Linux.CgroupsPath, meta.config.ID, name)
	}
	if spec.Annotations != nil {
		delete(spec.Annotations, api.AnnotationFamily)
		delete(spec.Annotations, api.AnnotationShimGroup)
	}
	labels := map[string]string{api.LabelName: name, api.LabelFamily: family, api.LabelStopped: imageDir}
	for k, v := range cfg.labels {
		labels[k] = v
	}
	ospec := oci.Spec(*spec)
	_, err = c.cd.NewContainer(ctx, name,
		containerd.WithImage(img),
		containerd.WithSnapshotter(sn),
		containerd.WithNewSnapshot(name, img),
		containerd.WithSpec(&ospec),
		containerd.WithRuntime(api.RuntimeName, cfg.runtimeOpts),
		containerd.WithContainerLabels(labels),
	)
	if err != nil {
		return nil, fail(fmt.Errorf("create container %s: %w", name, err))
	}
	return &ImportResult{Container: name, Family: family, Snapshot: imageDir, Pages: res.PagesMoved}, nil
}

// archiveMetadata is what an archive says about its container.
type archiveMetadata struct {
	config metadata.ContainerConfig
	spec   *specs.Spec
}

// readArchiveMetadata reads config.dump and spec.dump and checks that the
// archive has a CRIU image.
func readArchiveMetadata(p string) (*archiveMetadata, error) {
	tr, closer, err := ckptarchive.Open(p)
	if err != nil {
		return nil, err
	}
	defer closer.Close()
	var m archiveMetadata
	var haveConfig, haveSpec, haveImage bool
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("not a checkpoint archive (a tar as lazyfork export or a CRI checkpoint writes): %v: %w", err, errdefs.ErrInvalidArgument)
		}
		name := ckptarchive.EntryName(h)
		if name == path.Join(metadata.CheckpointDirectory, "inventory.img") && h.Typeflag == tar.TypeReg {
			haveImage = true
		}
		if name != metadata.ConfigDumpFile && name != metadata.SpecDumpFile || h.Typeflag != tar.TypeReg {
			continue
		}
		if h.Size > maxMetadataFile {
			return nil, fmt.Errorf("%s of %d bytes: %w", name, h.Size, errdefs.ErrInvalidArgument)
		}
		b, err := io.ReadAll(io.LimitReader(tr, maxMetadataFile))
		if err != nil {
			return nil, fmt.Errorf("%s: %v: %w", name, err, errdefs.ErrInvalidArgument)
		}
		if name == metadata.ConfigDumpFile {
			err, haveConfig = json.Unmarshal(b, &m.config), true
		} else {
			m.spec, haveSpec = &specs.Spec{}, true
			err = json.Unmarshal(b, m.spec)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %v: %w", name, err, errdefs.ErrInvalidArgument)
		}
	}
	var missing []string
	for n, ok := range map[string]bool{metadata.ConfigDumpFile: haveConfig, metadata.SpecDumpFile: haveSpec, metadata.CheckpointDirectory + "/inventory.img": haveImage} {
		if !ok {
			missing = append(missing, n)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("not a checkpoint archive: no %s (lazyfork export and CRI checkpoints write them): %w", strings.Join(missing, ", "), errdefs.ErrInvalidArgument)
	}
	if m.spec.Process == nil || m.spec.Root == nil {
		return nil, fmt.Errorf("%s has no process or root: %w", metadata.SpecDumpFile, errdefs.ErrInvalidArgument)
	}
	return &m, nil
}

// unpackArchive writes the regular files directly under checkpoint/ into
// image, and applies rootfs-diff.tar (an OCI layer) to upper as an overlay
// upper directory (whiteouts as overlay's). Entries are untrusted: only
// plain names one level below checkpoint/ are written, each created anew
// (O_EXCL, no links followed); the layer applier keeps every path inside
// upper. The whole must fit in what the tmpfs has free.
func unpackArchive(ctx context.Context, p, image, upper string) error {
	var fs unix.Statfs_t
	if err := unix.Statfs(image, &fs); err != nil {
		return err
	}
	_, err := ckptarchive.Unpack(p, image, ckptarchive.Options{
		Budget:  int64(fs.Bavail)*fs.Bsize - importTmpfsSpare,
		NoSpace: noSpace,
		Extra: map[string]func(io.Reader) error{
			metadata.RootFsDiffTar: func(r io.Reader) error {
				layer, err := compression.DecompressStream(r)
				if err != nil {
					return fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
				}
				defer layer.Close()
				_, err = archive.Apply(ctx, upper, layer, archive.WithConvertWhiteout(archive.OverlayConvertWhiteout))
				return err
			},
		},
	})
	return err
}

func noSpace(entry string, size, budget int64) error {
	return fmt.Errorf("entry %q of %d bytes does not fit: LazyFork's tmpfs has %d bytes left (less %d MiB kept free); free memory files (lazyfork gc, delete stopped containers) or raise LAZYFORK_TMPFS_SIZE: %w",
		entry, size, max(budget, 0), importTmpfsSpare>>20, errdefs.ErrResourceExhausted)
}

// claimFamily starts the family of an imported snapshot, held by holder
// while dir exists: the container's name, or with a suffix when a family of
// that name exists already.
func claimFamily(store *memfile.Store, ns, name, holder, dir string) (string, error) {
	sum := sha256.Sum256([]byte(ns + "/" + name + "/" + strconv.FormatInt(time.Now().UnixNano(), 10)))
	for _, family := range []string{name, name + "-" + hex.EncodeToString(sum[:4])} {
		if _, err := store.Owner(family); err == nil {
			continue
		}
		err := store.ClaimHeld(family, memfile.Owner{Namespace: ns, Root: name, Created: time.Now().UTC()}, holder, dir)
		if err == nil {
			return family, nil
		}
		if !errdefs.IsAlreadyExists(err) {
			return "", fmt.Errorf("start family %s: %w", family, err)
		}
	}
	return "", fmt.Errorf("no free family name for %s: %w", name, errdefs.ErrAlreadyExists)
}

// tmpfsSizeFromEnv is the shim's tmpfs size (LAZYFORK_TMPFS_SIZE), 0 for the
// kernel's default.
func tmpfsSizeFromEnv() int64 {
	n, _ := strconv.ParseInt(os.Getenv("LAZYFORK_TMPFS_SIZE"), 10, 64)
	return max(n, 0)
}
