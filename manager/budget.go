package manager

import (
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/provider"
)

// RequestBudgets gives providers the BMDB's request budgets
// (provider.Env.RequestBudget), which every process using an API account
// shares (SPEC §5.3).
func RequestBudgets(db *bmdb.DB) func(account string, rate float64, burst int) (provider.RequestBudget, error) {
	return func(account string, rate float64, burst int) (provider.RequestBudget, error) {
		b, err := db.RequestBudget(account, rate, burst)
		if err != nil {
			return nil, err // not a nil *bmdb.RequestBudget in a non-nil interface
		}
		return b, nil
	}
}
