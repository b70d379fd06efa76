package ladder

import (
	"slices"
	"strings"
	"testing"
)

func TestParseOrdersAndRefuses(t *testing.T) {
	got, err := Parse([]string{"power", " agent"})
	if err != nil {
		t.Fatal(err)
	}
	if want := []Rung{Agent, Power}; !slices.Equal(got, want) {
		t.Errorf("Parse = %v, want %v (the ladder's order)", got, want)
	}
	for _, tc := range []struct {
		in   []string
		want string
	}{
		{nil, "no recovery rungs given"},
		{[]string{"reboot", "kick"}, `unknown recovery rung "kick"; choose from agent,reboot,power,reinstall`},
		{[]string{"reboot", "reboot"}, `recovery rung "reboot" given twice`},
	} {
		_, err := Parse(tc.in)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Parse(%q) = %v, want an error containing %q", tc.in, err, tc.want)
		}
	}
}

func TestParseListRoundTrip(t *testing.T) {
	got, err := ParseList("reinstall,reboot")
	if err != nil {
		t.Fatal(err)
	}
	if s := Join(got); s != "reboot,reinstall" {
		t.Errorf("Join(ParseList) = %q", s)
	}
	if _, err := ParseList(" "); err == nil {
		t.Error("ParseList of a blank list succeeded")
	}
}

func TestRestarts(t *testing.T) {
	for _, r := range All {
		if r.Restarts() != (r != Agent) {
			t.Errorf("%s.Restarts() = %v", r, r.Restarts())
		}
		if r.Describe() == string(r) {
			t.Errorf("%s has no description", r)
		}
	}
	if Rung("x").Valid() {
		t.Error(`Rung("x").Valid()`)
	}
}

func TestOrder(t *testing.T) {
	got, err := Order([]Rung{Reinstall, Agent})
	if err != nil || !slices.Equal(got, []Rung{Agent, Reinstall}) {
		t.Errorf("Order = %v, %v; want agent,reinstall", got, err)
	}
	if _, err := Order([]Rung{Power, "warp"}); err == nil || !strings.Contains(err.Error(), `unknown recovery rung "warp"`) {
		t.Errorf("Order with an unknown rung: %v", err)
	}
	if _, err := Order(nil); err == nil {
		t.Error("Order of no rungs succeeded")
	}
}
