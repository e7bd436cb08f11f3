package main

import (
	"fmt"
	"strings"
)

// configReference is the settings table rendered as Markdown: one row per
// setting (environment name, file key, default, what it accepts, what it
// does), then the former file keys. `settings` prints it, and
// docs/configuration.md holds it (a test keeps the two the same).
func configReference() string {
	var b strings.Builder
	b.WriteString("| environment | file key | default | value | |\n|---|---|---|---|---|\n")
	var c config
	var former []string
	for _, s := range c.settings() {
		def := "—"
		if s.def != "" {
			def = "`" + s.def + "`"
		}
		doc := s.doc
		if s.required {
			doc = "**required**: " + doc
		}
		fmt.Fprintf(&b, "| `%s` | `%s` | %s | %s | %s |\n", s.env, s.key, def, s.value.rule(), strings.ReplaceAll(doc, "|", `\|`))
		if s.old != "" {
			former = append(former, fmt.Sprintf("| `%s` | `%s` |\n", s.old, s.key))
		}
	}
	b.WriteString("\n### Former file keys\n\nStill read, each logged as a `deprecated config key` warning naming the key to use instead." +
		" A new service needs none of them.\n\n| former file key | use instead |\n|---|---|\n" + strings.Join(former, "") + "\n")
	return b.String()
}
