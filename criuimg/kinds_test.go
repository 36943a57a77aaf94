package criuimg

import "testing"

func TestKindOfNames(t *testing.T) {
	for name, want := range map[string]string{
		"core-1.img": "CORE", "pagemap-123.img": "PAGEMAP", "fs-7.img": "FS", "files.img": "FILES",
		"tty-info.img": "TTY_INFO", "inventory.img": "INVENTORY", "/x/y/mm-42.img": "MM",
		"core-.img": "", "core-1a.img": "", "core.img": "", "fsnotify-1.img": "", "files-1.img": "",
		"pagemap-1.img.tmp": "", "pages-1.img": "", "inventory.img2": "",
	} {
		got := ""
		if k := KindOf(name); k != nil {
			got = k.Name
		}
		if got != want {
			t.Errorf("KindOf(%q) = %q, want %q", name, got, want)
		}
	}
}
