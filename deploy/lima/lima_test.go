package lima

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"

	"go.yaml.in/yaml/v3"

	"github.com/lazyfork/lazyfork/api"
)

// limaConfig is Lima's template format as its documented template,
// templates/default.yaml (Lima 1.x/2.x), describes it: every top-level field
// and, for the fields this template sets, their fields and types. Decoding
// with KnownFields rejects a field Lima does not document and a value of the
// wrong type.
type limaConfig struct {
	VMType                *string           `yaml:"vmType"`
	OS                    *string           `yaml:"os"`
	Arch                  *string           `yaml:"arch"`
	Images                []limaFile        `yaml:"images"`
	CPUs                  *int              `yaml:"cpus"`
	Memory                *string           `yaml:"memory"`
	Disk                  *string           `yaml:"disk"`
	Mounts                []limaMount       `yaml:"mounts"`
	MountTypesUnsupported []string          `yaml:"mountTypesUnsupported"`
	MountType             *string           `yaml:"mountType"`
	MountInotify          *bool             `yaml:"mountInotify"`
	AdditionalDisks       []any             `yaml:"additionalDisks"`
	SSH                   map[string]any    `yaml:"ssh"`
	CACerts               map[string]any    `yaml:"caCerts"`
	UpgradePackages       *bool             `yaml:"upgradePackages"`
	Containerd            *limaContainerd   `yaml:"containerd"`
	Provision             []limaProvision   `yaml:"provision"`
	Probes                []limaProbe       `yaml:"probes"`
	MinimumLimaVersion    *string           `yaml:"minimumLimaVersion"`
	VMOpts                map[string]any    `yaml:"vmOpts"`
	CPUType               map[string]string `yaml:"cpuType"`
	Rosetta               map[string]any    `yaml:"rosetta"`
	Timezone              *string           `yaml:"timezone"`
	Firmware              map[string]any    `yaml:"firmware"`
	Audio                 map[string]any    `yaml:"audio"`
	Video                 map[string]any    `yaml:"video"`
	Networks              []map[string]any  `yaml:"networks"`
	PortForwards          []limaPortForward `yaml:"portForwards"`
	CopyToHost            []map[string]any  `yaml:"copyToHost"`
	Message               *string           `yaml:"message"`
	Env                   map[string]string `yaml:"env"`
	Param                 map[string]string `yaml:"param"`
	PropagateProxyEnv     *bool             `yaml:"propagateProxyEnv"`
	HostResolver          map[string]any    `yaml:"hostResolver"`
	DNS                   []string          `yaml:"dns"`
	GuestInstallPrefix    *string           `yaml:"guestInstallPrefix"`
	Plain                 *bool             `yaml:"plain"`
	Base                  any               `yaml:"base"`
}

type limaFile struct {
	Location string `yaml:"location"`
	Arch     string `yaml:"arch"`
	Digest   string `yaml:"digest"`
}

type limaMount struct {
	Location   string         `yaml:"location"`
	MountPoint *string        `yaml:"mountPoint"`
	Writable   *bool          `yaml:"writable"`
	SSHFS      map[string]any `yaml:"sshfs"`
	NineP      map[string]any `yaml:"9p"`
	Virtiofs   map[string]any `yaml:"virtiofs"`
}

type limaContainerd struct {
	System   *bool      `yaml:"system"`
	User     *bool      `yaml:"user"`
	Archives []limaFile `yaml:"archives"`
}

type limaProvision struct {
	Mode                            string `yaml:"mode"`
	Script                          string `yaml:"script"`
	SkipDefaultDependencyResolution *bool  `yaml:"skipDefaultDependencyResolution"`
	Playbook                        string `yaml:"playbook"`
}

type limaProbe struct {
	Mode        string `yaml:"mode"`
	Description string `yaml:"description"`
	Script      string `yaml:"script"`
	Hint        string `yaml:"hint"`
}

type limaPortForward struct {
	GuestIPMustBeZero *bool   `yaml:"guestIPMustBeZero"`
	GuestIP           *string `yaml:"guestIP"`
	GuestPort         *int    `yaml:"guestPort"`
	GuestPortRange    []int   `yaml:"guestPortRange"`
	GuestSocket       string  `yaml:"guestSocket"`
	HostIP            *string `yaml:"hostIP"`
	HostPort          *int    `yaml:"hostPort"`
	HostPortRange     []int   `yaml:"hostPortRange"`
	HostSocket        string  `yaml:"hostSocket"`
	Proto             *string `yaml:"proto"`
	Reverse           *bool   `yaml:"reverse"`
	Ignore            *bool   `yaml:"ignore"`
}

func decode(t *testing.T) *limaConfig {
	t.Helper()
	var c limaConfig
	dec := yaml.NewDecoder(bytes.NewReader(Template))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil {
		t.Fatalf("lazyfork.yaml is not Lima's template format: %v", err)
	}
	return &c
}

var templateVar = regexp.MustCompile(`\{\{\s*([^}]*?)\s*\}\}`)

// checkVars fails on a template variable Lima does not offer in a field.
func checkVars(t *testing.T, field, s string, allowed []string, params map[string]string) {
	t.Helper()
	for _, m := range templateVar.FindAllStringSubmatch(s, -1) {
		v := m[1]
		if p, ok := strings.CutPrefix(v, ".Param."); ok {
			if _, declared := params[p]; !declared {
				t.Errorf("%s uses {{%s}}, not declared under param", field, v)
			}
			continue
		}
		ok := false
		for _, a := range allowed {
			ok = ok || v == "."+a
		}
		if !ok {
			t.Errorf("%s uses {{%s}}; Lima offers %v and .Param.KEY there", field, v, allowed)
		}
	}
}

// TestTemplateFormat checks lazyfork.yaml against Lima's documented format and
// the rules its validation (pkg/limayaml/validate.go) applies:
// known fields and types, values from the documented sets, the template
// variables each field may use, params that are declared and well named,
// probes that start with #!, and scripts that bash can parse.
func TestTemplateFormat(t *testing.T) {
	c := decode(t)
	in := func(field, v string, set ...string) {
		for _, s := range set {
			if v == s {
				return
			}
		}
		t.Errorf("%s: %q is not one of %v", field, v, set)
	}
	if c.VMType != nil {
		in("vmType", *c.VMType, "qemu", "vz", "wsl2", "krunkit", "default")
	}
	if c.Arch == nil {
		t.Fatal("arch unset: LazyFork's node runs on x86_64 only")
	}
	in("arch", *c.Arch, "x86_64")
	if len(c.Images) == 0 {
		t.Fatal("no images (Lima: must be specified)")
	}
	for _, im := range c.Images {
		in("images[].arch", im.Arch, "x86_64", "aarch64", "armv7l", "riscv64", "s390x", "ppc64le")
		if !strings.HasPrefix(im.Location, "https://") {
			t.Errorf("image %q: not an https URL", im.Location)
		}
	}
	size := regexp.MustCompile(`^[0-9]+(\.[0-9]+)?[KMGT]iB$`)
	for f, v := range map[string]*string{"memory": c.Memory, "disk": c.Disk} {
		if v != nil && !size.MatchString(*v) {
			t.Errorf("%s: %q is not a size such as \"4GiB\"", f, *v)
		}
	}
	if c.MinimumLimaVersion == nil || !regexp.MustCompile(`^[0-9]+\.[0-9]+\.[0-9]+$`).MatchString(*c.MinimumLimaVersion) {
		t.Errorf("minimumLimaVersion %v: want a version (param needs Lima 1.1)", c.MinimumLimaVersion)
	}
	paramKey := regexp.MustCompile(`^[A-Za-z][A-Za-z0-9_]*$`)
	for k, v := range c.Param {
		if !paramKey.MatchString(k) {
			t.Errorf("param %q: Lima's keys start with a letter, then letters, digits, underscores", k)
		}
		for _, r := range v {
			if !unicode.IsPrint(r) && r != ' ' && r != '\t' {
				t.Errorf("param %s: Lima refuses the unprintable %q", k, r)
			}
		}
		// Lima's validation: every key is used in a provision or probe
		// script, a mount, a port forward or copyToHost.
		used := regexp.MustCompile(`{{[^}]*\.Param\.` + k + `[^}]*}}|\bPARAM_` + k + `\b`)
		ok := false
		for _, p := range c.Provision {
			ok = ok || used.MatchString(p.Script)
		}
		for _, p := range c.Probes {
			ok = ok || used.MatchString(p.Script)
		}
		for _, m := range c.Mounts {
			ok = ok || used.MatchString(m.Location) || (m.MountPoint != nil && used.MatchString(*m.MountPoint))
		}
		for _, f := range c.PortForwards {
			ok = ok || used.MatchString(f.GuestSocket) || used.MatchString(f.HostSocket)
		}
		if !ok {
			t.Errorf("param %s is used nowhere: Lima refuses the template", k)
		}
	}
	expand := func(s string) string {
		return templateVar.ReplaceAllStringFunc(s, func(m string) string {
			v := templateVar.FindStringSubmatch(m)[1]
			if p, ok := strings.CutPrefix(v, ".Param."); ok {
				return c.Param[p]
			}
			return "/Users/someone/.lima/lazyfork" // {{.Dir}}, as on a Mac
		})
	}
	for _, m := range c.Mounts {
		checkVars(t, "mounts[].location", m.Location, []string{"Home", "Dir", "Name", "UID", "User"}, c.Param)
		if loc := expand(m.Location); !strings.HasPrefix(loc, "/") && !strings.HasPrefix(loc, "~") {
			t.Errorf("mount location %q (%q with the params' defaults): Lima wants an absolute path or ~", m.Location, loc)
		}
		if m.MountPoint != nil {
			checkVars(t, "mounts[].mountPoint", *m.MountPoint, []string{"Home", "Name", "UID", "User"}, c.Param)
			switch *m.MountPoint {
			case "/", "/bin", "/dev", "/etc", "/home", "/opt", "/sbin", "/tmp", "/usr", "/var":
				t.Errorf("mountPoint %s: Lima refuses system paths", *m.MountPoint)
			}
		}
	}
	if c.Containerd == nil || c.Containerd.System == nil || *c.Containerd.System || c.Containerd.User == nil || *c.Containerd.User {
		t.Error("Lima's own containerd is not disabled (LazyFork's make deps installs containerd)")
	}
	for i, p := range c.Provision {
		if strings.TrimSpace(p.Script) == "" {
			t.Errorf("provision[%d]: empty script (Lima refuses it)", i)
		}
		in("provision[].mode", p.Mode, "system", "user", "boot", "dependency", "ansible", "data", "yq")
		checkVars(t, "provision script", p.Script, []string{"Home", "UID", "User"}, c.Param)
		bashParses(t, fmt.Sprintf("provision[%d]", i), p.Script)
	}
	for _, p := range c.Probes {
		in("probes[].mode", p.Mode, "readiness")
		if !strings.HasPrefix(p.Script, "#!") {
			t.Errorf("probe %q does not start with #! (Lima requires it)", p.Description)
		}
		checkVars(t, "probe script", p.Script, []string{"Home", "UID", "User"}, c.Param)
		bashParses(t, "probe", p.Script)
	}
	for _, f := range c.PortForwards {
		if (f.GuestSocket == "") != (f.HostSocket == "") {
			t.Errorf("port forward %+v: a guestSocket wants a hostSocket", f)
		}
		checkVars(t, "guestSocket", f.GuestSocket, []string{"Home", "UID", "User"}, c.Param)
		checkVars(t, "hostSocket", f.HostSocket, []string{"Home", "Dir", "Name", "UID", "User"}, c.Param)
		if f.HostSocket != "" && !strings.HasPrefix(f.HostSocket, "{{.Dir}}/sock/") {
			t.Errorf("hostSocket %s: Lima says to put sockets into {{.Dir}}/sock", f.HostSocket)
		}
		if f.GuestSocket != "" && !strings.HasPrefix(f.GuestSocket, "/") {
			t.Errorf("guestSocket %s: Lima wants an absolute path", f.GuestSocket)
		}
		// macOS's UNIX_PATH_MAX is 104 (Lima checks it).
		if h := expand(f.HostSocket); len(h) >= 104-20 {
			t.Errorf("hostSocket %s is %d bytes under a typical instance directory: too close to macOS's 104", f.HostSocket, len(h))
		}
	}
	if c.Message != nil {
		checkVars(t, "message", *c.Message, []string{"Dir", "Name", "HostOS", "HostArch", "Status", "SSHLocalPort"}, c.Param)
	}
}

// bashParses checks a script with bash -n (template variables replaced).
func bashParses(t *testing.T, name, script string) {
	t.Helper()
	if _, err := exec.LookPath("bash"); err != nil {
		return
	}
	cmd := exec.Command("bash", "-n")
	cmd.Stdin = strings.NewReader(templateVar.ReplaceAllString(script, "x"))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("%s: bash -n: %v\n%s", name, err, out)
	}
}

// TestTemplateSocketsAndSetup: the template forwards the sockets the CLI
// reads (ContainerdSocket, APISocket) from where expose-sockets.sh serves
// containerd's socket and the node API, and sets the guest up with the
// make targets CI runs (.ci/run: make check, which runs make deps images)
// and the README's lazyfork setup: the same scripts, not a copy.
func TestTemplateSocketsAndSetup(t *testing.T) {
	c := decode(t)
	fw := map[string]string{}
	for _, f := range c.PortForwards {
		fw[f.GuestSocket] = f.HostSocket
	}
	if fw[GuestContainerdSocket] != "{{.Dir}}/"+ContainerdSocket || fw[GuestAPISocket] != "{{.Dir}}/"+APISocket || len(fw) != 2 {
		t.Errorf("forwards %v, want %s -> {{.Dir}}/%s and %s -> {{.Dir}}/%s", fw, GuestContainerdSocket, ContainerdSocket, GuestAPISocket, APISocket)
	}
	expose, err := os.ReadFile("expose-sockets.sh")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"unit containerd " + GuestContainerdSocket + " /run/containerd/containerd.sock ",
		"unit api " + GuestAPISocket + " " + api.DefaultAPISocket + " ",
	} {
		if !bytes.Contains(expose, []byte(want)) {
			t.Errorf("expose-sockets.sh does not serve %q", want)
		}
	}
	bashParses(t, "expose-sockets.sh", string(expose))

	var setup string
	for _, p := range c.Provision {
		if strings.Contains(p.Script, "make ") {
			setup += p.Script
			if p.Mode != "system" {
				t.Errorf("the set-up runs as %s, want system (root, as make deps and lazyfork setup need)", p.Mode)
			}
		}
	}
	repo, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	ci, err := os.ReadFile(filepath.Join(repo, ".ci", "run"))
	if err != nil {
		t.Fatal(err)
	}
	mk, err := os.ReadFile(filepath.Join(repo, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^make check$`).Match(ci) || !regexp.MustCompile(`(?m)^check: deps images `).Match(mk) ||
		!regexp.MustCompile(`(?m)^deps:.*\n\tbash scripts/deps.sh$`).Match(mk) || !regexp.MustCompile(`(?m)^images:.*\n\tbash scripts/images.sh$`).Match(mk) {
		t.Fatal("CI no longer runs make check -> make deps images -> scripts/deps.sh, scripts/images.sh: update the template's set-up with it")
	}
	for _, want := range []string{
		"tar -C /mnt/lazyfork-src", // the host's checkout, as mounted
		"\ncd \"$src\"\n",
		"\nmake deps images install\n", // CI's targets, and install (README)
		"\nlazyfork setup\n",
		"bash deploy/lima/expose-sockets.sh \"{{.User}}\"",
	} {
		if !strings.Contains(setup, want) {
			t.Errorf("the set-up does not run %q:\n%s", want, setup)
		}
	}
	// Not a second copy of the stack's installer.
	for _, copied := range []string{"criu", "runc", "nerdctl", "go install", "CONTAINERD_VERSION"} {
		if strings.Contains(strings.ToLower(setup), strings.ToLower(copied)) {
			t.Errorf("the set-up mentions %q: it belongs to scripts/deps.sh, which make deps runs", copied)
		}
	}
	var mount bool
	for _, m := range c.Mounts {
		mount = mount || (m.Location == "{{.Param.SOURCE}}" && m.MountPoint != nil && *m.MountPoint == "/mnt/lazyfork-src" && m.Writable != nil && !*m.Writable)
	}
	if !mount {
		t.Error("the host's checkout ({{.Param.SOURCE}}) is not mounted read-only at /mnt/lazyfork-src")
	}
	gomod, err := os.ReadFile(filepath.Join(repo, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	if m := regexp.MustCompile(`(?m)^go (\S+)$`).FindSubmatch(gomod); m == nil || c.Param["GO_VERSION"] != string(m[1]) {
		t.Errorf("param GO_VERSION %q is not go.mod's go line", c.Param["GO_VERSION"])
	}
	if _, ok := c.Param["SOURCE"]; !ok {
		t.Error("no param SOURCE (lazyfork vm start sets it)")
	}
}

// TestTemplateRejectsUnknown: the check fails a field Lima does not know.
func TestTemplateRejectsUnknown(t *testing.T) {
	var c limaConfig
	dec := yaml.NewDecoder(strings.NewReader("portForwards:\n- guestSocket: /a\n  hostSockets: /b\n"))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err == nil {
		t.Error("an unknown field passed")
	}
	dec = yaml.NewDecoder(strings.NewReader("cpus: four\n"))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err == nil {
		t.Error("a string cpus passed")
	}
}
